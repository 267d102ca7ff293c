"""Breakpoint: stop in pdb just before a node, with its inputs in scope.

Before (resnet18)::

    layer1_0_relu = getattr(self.layer1, "0").relu(layer1_0_bn1)
    layer1_0_conv2 = getattr(self.layer1, "0").conv2(layer1_0_relu)

After ``Breakpoint("layer1.0.conv2")``::

    layer1_0_relu = getattr(self.layer1, "0").relu(layer1_0_bn1)
    stop_layer1_0_conv2 = fxdebug_runtime_stop('layer1.0.conv2', 'Conv2d', {'layer1_0_relu': layer1_0_relu})
    layer1_0_conv2 = getattr(self.layer1, "0").conv2(layer1_0_relu)

Running the module prints the node's inputs and opens pdb on the generated
``forward`` at the line of ``layer1.0.conv2`` (see :mod:`fxdebug.runtime.debugger`;
``PYTHONBREAKPOINT=0`` turns every stop off). The stop node returns nothing
and changes no value.
"""

from __future__ import annotations

import difflib

import torch.fx as fx

from .. import runtime
from ..errors import SelectionError
from ..tracing.keys import META_KEY, META_PASS, META_SOURCE, node_key, op_name
from .base import Pass

__all__ = ["Breakpoint"]


class Breakpoint(Pass):
    """Insert a node that stops in pdb just before node ``key`` runs.

    Args:
        key: a node key (``"layer1.0.conv2"``), or a module path, which stops
            before the first node inside that module (``"layer1.0"``).
            ``None`` stops before the first node of ``forward``.

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))
        >>> gm = fxdebug.passes.Breakpoint("1")(gm).graph_module
        >>> print(gm.code.strip().splitlines()[3].strip())
        stop_1 = fxdebug_runtime_stop('1', 'Tanh', {'_0': _0});  stop_1 = None
        >>> import os; os.environ["PYTHONBREAKPOINT"] = "0"  # no stop in a doctest
        >>> gm(torch.ones(1, 2)).shape
        torch.Size([1, 2])
        >>> del os.environ["PYTHONBREAKPOINT"]
    """

    name = "breakpoint"

    def __init__(self, key: str | None = None) -> None:
        if key is not None and not isinstance(key, str):
            raise TypeError(f"Breakpoint(key) takes one node key as a string, got {key!r}; "
                            f"add one Breakpoint pass per node to stop at several.")
        self.key = key

    def run(self, gm: fx.GraphModule) -> bool:
        target = self._target(gm.graph)
        graph = gm.graph
        inputs = list(target.all_input_nodes) if target.op != "placeholder" else [target]
        if target.op == "placeholder":
            anchor = next(n for n in graph.nodes if n.op != "placeholder")
        else:
            anchor = target
        key = node_key(target)
        with graph.inserting_before(anchor):
            node = graph.create_node(
                "call_function", runtime.stop,
                (key, op_name(target, gm), {arg.name: arg for arg in inputs}), {},
                name=f"stop_{key}")
        node.meta[META_KEY] = f"{key}:breakpoint"
        node.meta[META_PASS] = self.name
        node.meta[META_SOURCE] = target.meta.get(META_SOURCE)
        return True

    def _target(self, graph: fx.Graph) -> fx.Node:
        nodes = [n for n in graph.nodes if n.op != "output"]
        if self.key is None:
            body = [n for n in nodes if n.op != "placeholder"]
            if not body:
                raise SelectionError("Breakpoint(): the graph has no node to stop before.")
            return body[0]
        for node in nodes:
            if node_key(node) == self.key:
                return node
        for node in nodes:
            if node_key(node).startswith(self.key + "."):
                return node
        keys = [node_key(n) for n in nodes]
        close = difflib.get_close_matches(self.key, keys, n=3, cutoff=0.5)
        hint = f" Close keys: {', '.join(map(repr, close))}." if close else ""
        raise SelectionError(f"pass 'breakpoint': no node or module has key {self.key!r}.{hint} "
                             f"fxdebug.trace(model) then [n.meta['fxdebug_key'] for n in "
                             f"gm.graph.nodes] lists the keys.")
