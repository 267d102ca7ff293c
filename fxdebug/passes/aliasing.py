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
hooks, ``begin_run``) only read: they neither alias nor write.
"""

from __future__ import annotations

import functools
import inspect
import operator

import torch
import torch.fx as fx

from .. import runtime
from ..runtime import torch_compat
from ..runtime.inplace_ops import INPLACE_OPERATORS
from ..tracing.keys import short_name

__all__ = ["AliasAnalysis", "mutated_argument", "inplace_requested", "opaque_writes",
           "is_fxdebug_read"]

# Functions fxdebug's inserted nodes call that only read their arguments.
_FXDEBUG_READS = (runtime.begin_run, runtime.capture, runtime.capture_stats,
                  runtime.record_grads, runtime.edit_grads, runtime.stop, runtime.begin_part)

# Ops that return a view of (or the very same tensor as) their first argument.
_VIEW_NAMES = frozenset("""
getitem view view_as reshape reshape_as flatten unflatten squeeze unsqueeze transpose t T
permute expand expand_as narrow select split split_with_sizes tensor_split chunk unbind
movedim moveaxis as_strided contiguous detach alias real imag diagonal unfold swapaxes
swapdims view_as_real view_as_complex hsplit vsplit dsplit to type type_as float double half
bfloat16 int long bool cpu cuda requires_grad_ dropout alpha_dropout feature_alpha_dropout
dropout1d dropout2d dropout3d broadcast_to atleast_1d atleast_2d atleast_3d data mT mH H
getattr identity
""".split())

# torch.nn module types that return a view of their input (or the input itself).
_ALIASING_MODULES = (torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten,
                     *torch_compat.DROPOUT_TYPES)


def _is_torch_callable(target) -> bool:
    module = getattr(target, "__module__", None) or ""
    return module in ("_operator", "operator", "builtins") or module == "torch" or module.startswith("torch.")


@functools.lru_cache(maxsize=None)
def _signature(target):
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a Python signature
        return None


def is_fxdebug_read(node: fx.Node) -> bool:
    """Whether ``node`` is one of fxdebug's own reading nodes (capture, gradient hook, ...).

    >>> import torch, fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
    >>> [n.name for n in gm.graph.nodes if is_fxdebug_read(n)]
    ['begin_run', 'capture_0']
    """
    return node.op == "call_function" and node.target in _FXDEBUG_READS


def _module_of(node: fx.Node, root: torch.nn.Module | _Submodules | None):
    if root is None:
        return None
    try:
        return root.get_submodule(str(node.target))
    except AttributeError:
        return None


class _Submodules:
    """``root.get_submodule`` answered from one walk of its modules (for a whole-graph analysis)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self._root = root
        self._modules = dict(root.named_modules(remove_duplicate=False))

    def get_submodule(self, target: str) -> torch.nn.Module:
        module = self._modules.get(target)
        return module if module is not None else self._root.get_submodule(target)


def _has_hooks(module: torch.nn.Module) -> bool:
    return torch_compat.has_module_hooks(module, backward=False)


def opaque_writes(node: fx.Node, root: torch.nn.Module | _Submodules | None) -> list[fx.Node]:
    """Inputs of ``node`` that code fx never saw may write in place; ``[]`` for known ops.

    Opaque: a call of a module whose code is not torch.nn's own (a user leaf
    module, an auto-leaf) or that has forward hooks, and a call of a function
    outside torch (a ``torch.fx.wrap``'d function). Their bodies are not in the
    graph, so any tensor they receive may come back changed.

    >>> import torch, fxdebug
    >>> class Leaf(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.mul_(2)
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), Leaf())
    >>> gm = fxdebug.trace(net, leaf_modules=[Leaf])
    >>> [[i.name for i in opaque_writes(n, gm)] for n in gm.graph.nodes if n.op == "call_module"]
    [[], ['_0']]
    """
    if node.op == "call_function":
        if is_fxdebug_read(node) or _is_torch_callable(node.target):
            return []
        return list(node.all_input_nodes)
    if node.op == "call_module":
        module = _module_of(node, root)
        if module is not None and type(module).__module__.startswith("torch.nn.modules") \
                and not _has_hooks(module):
            return []
        return list(node.all_input_nodes)
    return []


def inplace_requested(node: fx.Node) -> bool:
    """Whether a ``call_function`` node passes ``inplace=True``, by keyword or by position.

    >>> import torch, fxdebug
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.nn.functional.relu(x, True)
    >>> relu = [n for n in fxdebug.trace(Net()).graph.nodes if n.op == "call_function"][0]
    >>> inplace_requested(relu)
    True
    """
    if node.op != "call_function":
        return False
    if node.kwargs.get("inplace") is True:
        return True
    if not _is_torch_callable(node.target):
        return False
    signature = _signature(node.target)
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind_partial(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


def mutated_argument(node: fx.Node, root: torch.nn.Module | _Submodules | None
                     ) -> fx.Node | None:
    """The node whose storage ``node`` writes in place, or ``None``."""
    first = node.args[0] if node.args else None
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    if node.op == "call_function":
        if node.target in INPLACE_OPERATORS or node.target is operator.setitem:
            return first if isinstance(first, fx.Node) else None
        if inplace_requested(node):
            return first if isinstance(first, fx.Node) else None
        name = getattr(node.target, "__name__", "")
        if _is_torch_callable(node.target) and name.endswith("_") and not name.startswith("__"):
            return first if isinstance(first, fx.Node) else None  # torch.relu_, F.relu_ ...
    elif node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("__"):
            return first if isinstance(first, fx.Node) else None
    elif node.op == "call_module" and root is not None:
        module = _module_of(node, root)
        if getattr(module, "inplace", False) is True:
            return first if isinstance(first, fx.Node) else None
    return None


def _alias_inputs(node: fx.Node, root: torch.nn.Module | _Submodules | None) -> list[fx.Node]:
    """Inputs whose storage ``node``'s output may share."""
    if is_fxdebug_read(node):
        return []
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if mutated_argument(node, root) is not None:
        return first
    if node.op == "call_method":
        return first if str(node.target) in _VIEW_NAMES else []
    if node.op == "call_function":
        if _is_torch_callable(node.target):
            return first if short_name("call_function", node.target) in _VIEW_NAMES else []
        return list(node.all_input_nodes)  # a user function: may return any input
    if node.op == "call_module":
        module = _module_of(node, root)
        if module is not None and type(module).__module__.startswith("torch.nn.modules") \
                and not isinstance(module, _ALIASING_MODULES):
            return []
        return list(node.all_input_nodes)
    return []


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
        modules = _Submodules(gm)
        for node in gm.graph.nodes:
            for source in _alias_inputs(node, modules):
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
