"""Which nodes share storage, and which later nodes write to it in place.

A capture keeps a detached view of a node's tensor, which is free, unless a
later in-place op writes to the same storage (``relu(inplace=True)`` after a
batch norm, ``out += identity``, ``x[:, 0] = 0``, ``x.data.zero_()``): then the
view would change under the user's feet, and the capture must copy.

The analysis is conservative: a module or function it does not know is
assumed to return a view of its inputs, and to write to them in place (a leaf
module or a ``torch.fx.wrap``'d function whose body fx never saw may run
``x.mul_(2)``; so may a forward hook), so an unknown op can only cause an
extra copy, never a wrong capture. fxdebug's own nodes (captures, gradient
hooks, ``begin_run``) only read: they neither alias nor write. The rules for one
node are :mod:`fxdebug.tracing.alias_rules`; this module joins them over a graph.
"""

from __future__ import annotations

import torch.fx as fx

from ..tracing.alias_rules import Submodules, alias_inputs, mutated_argument, opaque_writes

__all__ = ["AliasAnalysis"]


class AliasAnalysis:
    """Storage classes of a graph's nodes and the in-place writes to them.

    >>> import torch, fxdebug
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(inplace=True))
    >>> gm = fxdebug.trace(net)
    >>> linear = [n for n in gm.graph.nodes if n.target == "0"][0]
    >>> AliasAnalysis(gm).written_after([linear], linear)
    True
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        self._parent: dict[fx.Node, fx.Node] = {}
        self._position: dict[fx.Node, int] = {}
        self._writes: list[tuple[int, fx.Node]] = []
        self._opaque: list[tuple[int, fx.Node]] = []
        for index, node in enumerate(gm.graph.nodes):
            self._position[node] = index
            self._parent[node] = node
        modules = Submodules(gm)
        for node in gm.graph.nodes:
            for source in alias_inputs(node, modules):
                self._union(node, source)
            target = mutated_argument(node, modules)
            if target is not None:
                self._writes.append((self._position[node], target))
            for written in opaque_writes(node, modules):
                self._opaque.append((self._position[node], written))

    def _find(self, node: fx.Node) -> fx.Node:
        root = node
        while self._parent[root] is not root:
            root = self._parent[root]
        while self._parent[node] is not root:
            self._parent[node], node = root, self._parent[node]
        return root

    def _union(self, a: fx.Node, b: fx.Node) -> None:
        if b not in self._parent:
            return
        ra, rb = self._find(a), self._find(b)
        if ra is not rb:
            # keep the earlier node as the representative: deterministic
            if self._position[ra] < self._position[rb]:
                self._parent[rb] = ra
            else:
                self._parent[ra] = rb

    def written_after(self, nodes, anchor: fx.Node, opaque: bool = True) -> bool:
        """Whether a node after ``anchor`` writes in place to the storage of any of ``nodes``.

        With ``opaque`` (the default), a later opaque call (see
        :func:`opaque_writes`) that receives that storage counts as a write.
        """
        classes = {id(self._find(node)) for node in nodes if node in self._parent}
        after = self._position[anchor]
        writes = self._writes + self._opaque if opaque else self._writes
        return any(position > after and id(self._find(target)) in classes
                   for position, target in writes if target in self._parent)

    def members(self, node: fx.Node) -> list[fx.Node]:
        """Every node that may share ``node``'s storage (itself included), in graph order."""
        if node not in self._parent:
            return [node]
        root = self._find(node)
        return [other for other in self._position if self._find(other) is root]

    def writes(self) -> list[tuple[fx.Node, fx.Node]]:
        """``(writer, written)`` pairs: each in-place node and the node whose storage it writes."""
        nodes = list(self._position)
        return [(nodes[position], target) for position, target in self._writes]
