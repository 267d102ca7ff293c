"""Stable node keys and canonical target names.

A key names a node the way a person names a layer: the module path of the call
plus a local counter for repeated calls, as torchvision's feature extraction
does (``layer1.0.conv1``, ``layer1.0.relu``, ``layer1.0.relu_1``,
``layer1.0.iadd``). Keys depend only on the model's code and module names, so
they are identical across processes and hash seeds.

Node meta written by fxdebug (all keys start with ``fxdebug_``):

    fxdebug_key      the stable key (str)
    fxdebug_source   (filename, lineno) of the user statement, or None
    fxdebug_returns  module outputs that end at this node (see tracing.py)
    fxdebug_pass     name of the pass that inserted the node
    fxdebug_provenance  [(node name, key), ...] of the nodes this node replaced
                     (written by :func:`inherit_key`)
    fxdebug_lowered_from  "operator.iadd" (isub, imul, itruediv) on a ``+=`` traced
                     out of place because nothing can observe the write
                     (see inplace_lowering.py)
"""

from __future__ import annotations

import builtins
import operator
import re

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..base import torch_compat

__all__ = ["node_key", "target_name", "op_name", "short_name", "KeyAllocator",
           "assign_missing_keys", "inherit_key", "META_KEY", "META_SOURCE", "META_RETURNS",
           "META_PASS", "META_PROVENANCE", "META_MODULE", "module_path", "join_path",
           "prefix_keys", "ModuleReturn"]

META_KEY = "fxdebug_key"
META_SOURCE = "fxdebug_source"
META_RETURNS = "fxdebug_returns"
META_PASS = "fxdebug_pass"
META_MODULE = "fxdebug_module"
META_PROVENANCE = "fxdebug_provenance"

_NON_IDENTIFIER = re.compile(r"[^0-9a-zA-Z_]")


class KeyAllocator:
    """Hands out unique keys; module calls are numbered per call, as forward hooks count them.

    The n-th call (from 0) of the module at path ``p`` is keyed ``p`` (n = 0)
    or ``p_n``, whatever ran in between. Any other node (a function, a
    method) is keyed ``base``, ``base_1``... but never with a module path or
    a module call's key: where its base is a module path (``F.relu`` next to
    a module ``relu``) it becomes ``base_fn``.

    >>> keys = KeyAllocator(owned=["relu", "fc"])
    >>> [keys.allocate("relu", owner=True), keys.allocate("relu"),
    ...  keys.allocate("relu", owner=True), keys.allocate("relu", owner=True), keys.allocate("fc_1")]
    ['relu', 'relu_fn', 'relu_1', 'relu_2', 'fc_1_1']

    Should a module call's key be the path of another module (modules ``relu``
    and ``relu_1``, ``relu`` called twice), the call takes the next free number.
    """

    def __init__(self, owned=()) -> None:
        self._used: dict[str, None] = {}
        self._calls: dict[str, int] = {}
        self._next: dict[str, int] = {}
        self._owned: dict[str, None] = dict.fromkeys(owned)

    def _is_call_key(self, candidate: str) -> bool:
        """Whether ``candidate`` is, or may become, the key of a module call."""
        if candidate in self._owned:
            return True
        head, _, tail = candidate.rpartition("_")
        return bool(head) and tail.isdigit() and head in self._owned

    def allocate(self, base: str, owner: bool = False) -> str:
        """The next free key for ``base``; ``owner``: a call of the module whose path ``base`` is."""
        if owner:
            index = self._calls.get(base, 0)
            candidate = base if index == 0 else f"{base}_{index}"
            while candidate in self._used or (candidate != base and candidate in self._owned):
                index += 1
                candidate = f"{base}_{index}"
            self._calls[base] = index + 1
            self._used[candidate] = None
            return candidate
        while base in self._owned:
            base = f"{base}_fn"
        candidate = base
        index = self._next.get(base, 0)
        while candidate in self._used or self._is_call_key(candidate):
            index += 1
            candidate = f"{base}_{index}"
        self._next[base] = index
        self._used[candidate] = None
        return candidate

    def reserve(self, key: str) -> None:
        self._used[key] = None


class ModuleReturn(tuple):
    """One module call's output, stored in ``node.meta["fxdebug_returns"]``.

    Fields: ``key`` (module path plus call counter), ``module_type`` (class
    name), ``items`` (tuple of ``(subpath, node_name)``; subpath ``""`` for a
    single tensor, ``"0"``, ``"logits"``, ``"1/0"`` for nested outputs) and
    ``source`` (the user ``(filename, lineno)`` of the call).
    """

    __slots__ = ()

    def __new__(cls, key: str, module_type: str, items: tuple, source):
        return super().__new__(cls, (key, module_type, items, source))

    key = property(operator.itemgetter(0))
    module_type = property(operator.itemgetter(1))
    items = property(operator.itemgetter(2))
    source = property(operator.itemgetter(3))

    def __reduce__(self):
        return (ModuleReturn, tuple(self))


def short_name(kind: str, target) -> str:
    """The local name of a node's target: ``add``, ``flatten``, ``view``, ``conv1``."""
    if kind == "call_function":
        name = getattr(target, "__name__", None) or type(target).__name__
        return _NON_IDENTIFIER.sub("_", name)
    if kind == "placeholder":
        return str(target).lstrip("*")
    return str(target)


def key_base(kind: str, target, scope: str) -> str:
    """Key before de-duplication: module path for module calls, else ``scope.name``."""
    if kind in ("call_module", "get_attr"):
        return str(target)
    if kind == "output":
        return "output"
    name = short_name(kind, target)
    if kind == "placeholder" or not scope:
        return name
    return f"{scope}.{name}"


def node_key(node: fx.Node) -> str:
    """The stable key of ``node`` (falls back to the fx node name)."""
    return node.meta.get(META_KEY, node.name)


def target_name(target) -> str:
    """Canonical, address-free name of a call_function target.

    >>> import operator, torch
    >>> target_name(operator.add), target_name(torch.relu)
    ('operator.add', 'torch.relu')
    >>> target_name(torch.nn.functional.linear), target_name(torch.ops.aten.conv2d.default)
    ('torch.nn.functional.linear', 'aten.conv2d.default')
    """
    if torch_compat.is_op_overload(target) or torch_compat.is_op_packet(target):
        return str(target)  # aten.conv2d.default (graphs from torch.export)
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None)
    if name is None:
        return type(target).__qualname__
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if target is getattr(builtins, name, None):
        return name
    for prefix, namespace in (("torch", torch), ("torch.nn.functional", F),
                              ("torch.special", torch.special), ("torch.linalg", torch.linalg),
                              ("torch.fft", torch.fft)):
        if getattr(namespace, name, None) is target:
            return f"{prefix}.{name}"
    qualname = getattr(target, "__qualname__", name)
    return f"{module}.{qualname}" if module else qualname


def op_name(node: fx.Node, root: torch.nn.Module | None = None,
            modules: dict[str, torch.nn.Module] | None = None) -> str:
    """What a node does, for tables: ``Conv2d``, ``torch.flatten``, ``Tensor.view``.

    ``modules``: ``dict(root.named_modules(remove_duplicate=False))`` when asked
    for many nodes (a dict lookup instead of walking the path each time).
    """
    if node.op == "call_module":
        if modules is not None and isinstance(modules.get(str(node.target)), torch.nn.Module):
            return type(modules[str(node.target)]).__name__
        if root is not None:
            try:
                return type(root.get_submodule(str(node.target))).__name__
            except AttributeError:
                pass
        return str(node.target)
    if node.op == "call_function":
        return target_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return node.op


def inherit_key(new_node: fx.Node, old_node: fx.Node) -> fx.Node:
    """Let ``new_node`` carry the key and source line of ``old_node``, which it replaces.

    Call it in a pass that replaces a node by a new one computing the same
    value (or, in a faulty pass, a value meant to be the same): equivalence
    checks then compare the two, and diffs show a change instead of a removal
    and an addition. ``old_node`` (name and key) is appended to
    ``new_node.meta["fxdebug_provenance"]``. Give a fused node the key of the
    node whose value it computes (for conv+bn, the bn). Returns ``new_node``.

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.ReLU()))
    >>> relu = [n for n in gm.graph.nodes if n.op == "call_module"][0]
    >>> with gm.graph.inserting_after(relu):
    ...     new = gm.graph.call_function(torch.sigmoid, relu.args)
    >>> relu.replace_all_uses_with(new); gm.graph.erase_node(relu)
    [output]
    >>> inherit_key(new, relu).meta["fxdebug_key"], new.meta["fxdebug_provenance"]
    ('0', [('_0', '0')])
    """
    old_key = node_key(old_node)
    new_node.meta[META_KEY] = old_key
    if old_node.meta.get(META_SOURCE) is not None:
        new_node.meta[META_SOURCE] = old_node.meta[META_SOURCE]
    if META_MODULE in old_node.meta:
        new_node.meta[META_MODULE] = old_node.meta[META_MODULE]
    if "nn_module_stack" in old_node.meta and "nn_module_stack" not in new_node.meta:
        new_node.meta["nn_module_stack"] = old_node.meta["nn_module_stack"]
    provenance = list(new_node.meta.get(META_PROVENANCE, ()))
    provenance.extend(old_node.meta.get(META_PROVENANCE, ()))
    provenance.append((old_node.name, old_key))
    new_node.meta[META_PROVENANCE] = provenance
    return new_node


def module_path(node: fx.Node) -> str:
    """The module a node belongs to: its target for module calls, else the enclosing module."""
    if node.op == "call_module":
        return str(node.target)
    if META_MODULE in node.meta:
        return node.meta[META_MODULE]
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def assign_missing_keys(graph: fx.Graph) -> None:
    """Give keys to nodes of a graph fxdebug did not trace (e.g. a user's own fx pass output).

    Scopes come from ``nn_module_stack`` meta when fx recorded it, so keys
    still read like module paths.
    """
    keys = KeyAllocator()
    for node in graph.nodes:
        if META_KEY in node.meta:
            keys.reserve(node.meta[META_KEY])
    for node in graph.nodes:
        if META_KEY in node.meta:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        scope = ""
        if stack:
            scope = list(stack.values())[-1][0]
        if node.op == "call_module":
            scope = ""
        node.meta[META_KEY] = keys.allocate(key_base(node.op, node.target, scope))


def join_path(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` alone under the root module.

    >>> join_path("backbone.body", "layer1"), join_path("", "layer1"), join_path("rpn", "")
    ('backbone.body.layer1', 'layer1', 'rpn')
    """
    if not prefix:
        return name
    return f"{prefix}.{name}" if name else prefix


def prefix_keys(graph: fx.Graph, prefix: str) -> None:
    """Put the module path ``prefix`` in front of every key of ``graph``, in place.

    For a graph traced from a submodule: its keys then read as they would in
    a trace of the whole model (``conv1`` of ``backbone.body`` becomes
    ``backbone.body.conv1``). Module scopes and the keys of module outputs
    (``fxdebug_returns``) are prefixed too.

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> prefix_keys(gm.graph, "head.mlp")
    >>> [node_key(n) for n in gm.graph.nodes]
    ['head.mlp.input', 'head.mlp.0', 'head.mlp.1', 'head.mlp.output']
    """
    if not prefix:
        return
    for node in graph.nodes:
        node.meta[META_KEY] = join_path(prefix, node_key(node))
        if META_MODULE in node.meta:
            node.meta[META_MODULE] = join_path(prefix, node.meta[META_MODULE])
        returns = node.meta.get(META_RETURNS)
        if returns:
            node.meta[META_RETURNS] = [type(ret)(join_path(prefix, ret.key), ret.module_type,
                                                 ret.items, ret.source) for ret in returns]

