"""``trace()``: a faithful symbolic trace with stable keys and user source lines.

Call tree::

    trace(model, *example_inputs, frontend="fx")
      ├─ frontend="export": export_frontend.export_trace(model, *example_inputs)
      ├─ frontend="auto":   fx, else export, else partial.trace_parts(model)
    _trace_fx(model)
      └─ for each attempt (one more auto-leaf per failed attempt)
           ├─ _Tracer.trace(model)                torch.fx.Tracer, plus:
           │    ├─ create_node   -> meta: fxdebug_key, fxdebug_source
           │    ├─ call_module   -> scope stack; non-leaf outputs -> fxdebug_returns
           │    └─ proxy         -> _FaithfulProxy (keeps ``+=`` and ``x[i] = v`` in place)
           └─ on failure: explain_failure() -> TraceFailure
                 └─ auto_leaf and the failure is inside a submodule: retry with it as a leaf
      └─ DebugGraphModule(model, graph)

Plain ``torch.fx.symbolic_trace`` rewrites ``v += 1`` on a traced tensor into
``v = v + 1``: a view of the input is no longer written through, so the traced
model computes different numbers than eager. fxdebug's proxies keep augmented
assignments in place (``operator.iadd``; fx prints it as ``v += 1``).
"""

from __future__ import annotations

import copy
import logging
import math
import operator
import sys
import warnings
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.proxy import Attribute

from .errors import TraceFailure
from .graph_module import DebugGraphModule
from .keys import META_KEY, META_MODULE, META_RETURNS, META_SOURCE, KeyAllocator, key_base
from .locations import caller_stacklevel, user_location
from .trace_failure import explain_failure

__all__ = ["trace"]

log = logging.getLogger("fxdebug")

_INPLACE_OPERATOR_NAMES = ("iadd", "iand", "ifloordiv", "ilshift", "imod", "imul",
                           "imatmul", "ior", "ipow", "irshift", "isub", "itruediv", "ixor")


class _InplaceMixin:
    """Augmented assignment and item assignment recorded as in-place graph nodes."""

    def __getattr__(self, name):
        return _FaithfulAttribute(self, name)

    def __setitem__(self, index, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})


def _make_inplace(name: str):
    target = getattr(operator, name)

    def method(self, other):
        return self.tracer.create_proxy("call_function", target, (self, other), {})

    method.__name__ = f"__{name}__"
    return method


for _name in _INPLACE_OPERATOR_NAMES:
    setattr(_InplaceMixin, f"__{_name}__", _make_inplace(_name))


class _FaithfulAttribute(_InplaceMixin, Attribute):
    pass


class _FaithfulProxy(_InplaceMixin, fx.Proxy):
    pass


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


def _flatten_proxies(value: Any, prefix: str = "") -> list[tuple[str, fx.Proxy]]:
    """``(subpath, proxy)`` for every proxy in a nested module output, in order."""
    if isinstance(value, fx.Proxy):
        return [(prefix, value)]
    join = (lambda name: f"{prefix}/{name}") if prefix else str
    items: Iterable[tuple[Any, Any]] = ()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        items = zip(value._fields, value)
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    elif hasattr(value, "__dataclass_fields__"):
        items = ((name, getattr(value, name)) for name in value.__dataclass_fields__)
    found: list[tuple[str, fx.Proxy]] = []
    for name, item in items:
        found.extend(_flatten_proxies(item, join(name)))
    return found


class _Tracer(fx.Tracer):
    """torch.fx Tracer that records keys, user source lines and module outputs.

    Also used by torch when it unpickles a GraphModule traced by fxdebug, so
    the constructor must work without arguments.
    """

    def __init__(self, leaf_paths: Iterable[str] = (), leaf_types: tuple[type, ...] = (),
                 autowrap_modules=(math,), autowrap_functions=()):
        super().__init__(autowrap_modules=autowrap_modules, autowrap_functions=autowrap_functions)
        self.leaf_paths = tuple(leaf_paths)
        self.leaf_types = tuple(leaf_types)
        self._module_scope: list[str] = []
        self.keys = KeyAllocator()  # re-made with the root's module paths in trace()
        self.failure_scope: tuple[str, ...] | None = None
        self._order: dict[fx.Node, int] = {}
        self._recorder_proxies: dict[str, fx.Proxy] = {}

    def trace(self, root, concrete_args=None):
        if isinstance(root, torch.nn.Module):
            self.keys = KeyAllocator(owned=(name for name, _ in root.named_modules() if name))
        return super().trace(root, concrete_args)

    # -- graph construction ----------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _FaithfulProxy(node, self)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        scope = self._module_scope[-1] if self._module_scope else ""
        node.meta[META_KEY] = self.keys.allocate(key_base(kind, target, scope),
                                                 owner=kind == "call_module")
        node.meta[META_SOURCE] = user_location(sys._getframe(1))
        node.meta[META_MODULE] = str(target) if kind == "call_module" else scope
        self._order[node] = len(self._order)
        return node

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        from .runtime import Recorder  # local: runtime imports records, not tracing
        if isinstance(attr_val, Recorder):
            # One get_attr node for the recorder when a GraphModule is re-traced.
            if attr not in self._recorder_proxies:
                self._recorder_proxies[attr] = self.create_proxy("get_attr", attr, (), {})
            return self._recorder_proxies[attr]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        source = user_location(sys._getframe(1))
        key = self.keys.allocate(path, owner=True)
        self._module_scope.append(path)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failure_scope is None:
                self.failure_scope = tuple(self._module_scope)
            raise
        finally:
            self._module_scope.pop()
        self._note_module_return(key, type(m).__name__, out, source)
        return out

    def _note_module_return(self, key, module_type, out, source) -> None:
        items = [(subpath, proxy.node) for subpath, proxy in _flatten_proxies(out)
                 if isinstance(proxy.node, fx.Node) and proxy.node.graph is self.graph]
        if not items or not self._order:
            return
        # The module's output is complete when its last node has run.
        end = max(self._order, key=self._order.__getitem__)
        record = ModuleReturn(key, module_type, tuple((s, n.name) for s, n in items), source)
        end.meta.setdefault(META_RETURNS, []).append(record)


def shallow_module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` alone: same parameters, buffers and submodules, own dictionaries.

    >>> lin = torch.nn.Linear(2, 2)
    >>> twin = shallow_module_copy(lin)
    >>> twin.weight is lin.weight, twin._parameters is lin._parameters
    (True, False)
    """
    new = object.__new__(type(module))  # not copy.copy: some modules pickle their state oddly
    new.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():
        if name.startswith("_") and isinstance(value, (dict, set)):
            new.__dict__[name] = copy.copy(value)
    return new


def module_tree_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of every module in the tree that shares the parameters and buffers.

    Tracing runs ``forward`` on it, so attributes a ``forward`` sets (a cache
    of sizes, fx's tensor constants) land on the copy, never on the user's
    model. Each module gets its own submodule, parameter, buffer and hook
    dictionaries; the tensors in them are the model's own.

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> twin = module_tree_copy(net)
    >>> twin is net, twin[0] is net[0], twin[0].weight is net[0].weight
    (False, False, True)
    """
    memo: dict[int, torch.nn.Module] = {}

    def copy_module(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        new = memo[id(module)] = shallow_module_copy(module)
        for name, child in module._modules.items():
            if child is not None:
                new._modules[name] = copy_module(child)
        return new

    return copy_module(model)


def _resolve_leaves(model: torch.nn.Module, leaf_modules) -> tuple[list[str], tuple[type, ...]]:
    paths: list[str] = []
    types: list[type] = []
    names = dict(model.named_modules())
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            types.append(leaf)
        elif isinstance(leaf, str):
            if leaf not in names:
                import difflib
                close = difflib.get_close_matches(leaf, list(names), n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(f"leaf_modules names {leaf!r}, which is not a submodule of "
                                 f"{type(model).__name__}.{hint} Use a path from "
                                 f"model.named_modules() or a module class.")
            paths.append(leaf)
        elif isinstance(leaf, torch.nn.Module):
            matches = [name for name, module in names.items() if module is leaf]
            if not matches:
                raise ValueError(f"leaf_modules holds a {type(leaf).__name__} instance that is not "
                                 f"a submodule of {type(model).__name__}; pass its path instead.")
            paths.append(matches[0])
        else:
            raise TypeError(f"leaf_modules entries must be module paths (str) or nn.Module classes, "
                            f"got {leaf!r} of type {type(leaf).__name__}.")
    return paths, tuple(types)


_FRONTENDS = ("fx", "export", "auto")


def trace(model: torch.nn.Module, *example_inputs, leaf_modules: Iterable = (),
          concrete_args: dict | None = None, auto_leaf: bool = True,
          frontend: str = "fx") -> fx.GraphModule:
    """Trace ``model`` into a GraphModule with stable keys and source lines.

    Args:
        model: the module to trace; it is not modified and shares its
            parameters with the result.
        example_inputs: positional inputs; needed by ``frontend="export"``
            (and by ``"auto"`` to try export).
        leaf_modules: module paths (``"layer1.0"``) or classes to keep as
            single ``call_module`` nodes instead of tracing through them.
        concrete_args: forwarded to ``torch.fx.Tracer.trace`` to fix
            arguments that control flow depends on.
        auto_leaf: when tracing fails inside a submodule, retry with that
            submodule as a leaf. The modules this turned into leaves are
            listed in a warning and in ``gm.meta["fxdebug_auto_leaves"]``.
        frontend: ``"fx"`` (symbolic tracing), ``"export"`` (``torch.export``
            on the example inputs; keys still module paths, see
            :mod:`fxdebug.export_frontend`) or ``"auto"``: fx, else export,
            else the model split into traced parts and eager glue (see
            :mod:`fxdebug.partial`). ``gm.meta["fxdebug_frontend"]`` says which
            was used and ``gm.meta["fxdebug_frontend_notes"]`` why the others
            were not (a partially traced model has them in
            ``model.fxdebug_partial``).

    Returns:
        A ``torch.fx.GraphModule``; every node has ``node.meta["fxdebug_key"]``
        and ``node.meta["fxdebug_source"]`` (user ``(filename, lineno)``).
        With ``frontend="auto"`` and neither fx nor export working, the
        partially traced model (an ``nn.Module``; pass it to ``instrument``).

    Raises:
        TraceFailure: naming the module, the user's ``file:line``, the kind of
            failure and the fix.

    Example::

        >>> import torch, torchvision, fxdebug
        >>> gm = fxdebug.trace(torchvision.models.resnet18())
        >>> [n.meta["fxdebug_key"] for n in gm.graph.nodes][5:9]
        ['layer1.0.conv1', 'layer1.0.bn1', 'layer1.0.relu', 'layer1.0.conv2']
    """
    from .partial import is_partial
    if is_partial(model):
        raise TraceFailure(
            f"fxdebug cannot trace {type(model).__name__} as one graph: it is the part-by-part "
            f"model fxdebug made because the root cannot be traced. Fix: work on its traced "
            f"parts, fxdebug.traced_parts(model) (their inputs: fxdebug.part_inputs(model, "
            f"*inputs)), or pass the original model with frontend='export'.",
            module_path="", module_type=type(model).__name__, location=None,
            kind="a partially traced model", fix="use fxdebug.traced_parts(model)")
    if frontend not in _FRONTENDS:
        raise ValueError(f"frontend={frontend!r}: use 'fx' (symbolic tracing), 'export' "
                         f"(torch.export on example inputs) or 'auto' (fx, then export, then "
                         f"the traceable parts).")
    if frontend == "export":
        from .export_frontend import export_trace
        return export_trace(model, *example_inputs)
    if frontend == "auto":
        return _trace_auto(model, example_inputs, leaf_modules, concrete_args, auto_leaf)
    return _trace_fx(model, leaf_modules, concrete_args, auto_leaf)


def _trace_auto(model, example_inputs, leaf_modules, concrete_args, auto_leaf):
    """fx, else export, else partial; the result says which and why."""
    from .export_frontend import export_trace
    from .partial import trace_parts
    notes: list[str] = []
    try:
        gm = _trace_fx(model, leaf_modules, concrete_args, auto_leaf)
    except TraceFailure as failure:
        fx_failure = failure
        notes.append(f"fx: {' '.join(str(failure).split())}")
    else:
        gm.meta["fxdebug_frontend_notes"] = notes
        return gm
    if example_inputs:
        try:
            gm = export_trace(model, *example_inputs)
        except TraceFailure as failure:
            notes.append(f"export: {' '.join(str(failure).split())}")
        else:
            gm.meta["fxdebug_frontend_notes"] = notes
            warnings.warn(f"fxdebug.trace(frontend='auto') used torch.export for "
                          f"{type(model).__name__}: symbolic tracing failed ({fx_failure.kind} at "
                          f"{fx_failure.location}).", stacklevel=caller_stacklevel())
            return gm
    else:
        notes.append("export: not tried, no example inputs (pass them: "
                     "fxdebug.trace(model, *example_inputs, frontend='auto'))")
    if next(model.children(), None) is None:
        raise fx_failure  # no submodules, no parts
    return trace_parts(model, fx_failure, leaf_modules, notes[1:])  # it notes fx_failure itself


def _trace_fx(model: torch.nn.Module, leaf_modules: Iterable = (),
              concrete_args: dict | None = None, auto_leaf: bool = True) -> fx.GraphModule:
    """Symbolic tracing with auto-leaf (the ``"fx"`` front end)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxdebug.trace expects an nn.Module, got {type(model).__name__}. "
                        f"Wrap a plain function in a Module, or call torch.fx.symbolic_trace on it.")
    leaf_paths, leaf_types = _resolve_leaves(model, leaf_modules)
    auto_leaves: list[tuple[str, str]] = []
    while True:
        tracer = _Tracer(leaf_paths + [path for path, _ in auto_leaves], leaf_types)
        # fx writes tensor constants onto the traced root: a shallow copy keeps them off the
        # user's module, while submodules stay shared as in torch.fx (model.eval() reaches gm)
        root = shallow_module_copy(model)
        try:
            graph = tracer.trace(root, concrete_args=concrete_args)
            break
        except Exception as exc:  # any failure of user code under tracing is explained
            failure = explain_failure(exc, model, tracer.failure_scope or (), tuple(auto_leaves))
            can_retry = (auto_leaf and failure.module_path
                         and failure.module_path not in leaf_paths
                         and failure.module_path not in [p for p, _ in auto_leaves])
            if not can_retry:
                raise failure from exc
            reason = f"{failure.kind} at {failure.location}"
            log.info("auto-leaf: %s (%s): %s", failure.module_path, failure.module_type, reason)
            auto_leaves.append((failure.module_path, reason))
    gm = DebugGraphModule(root, graph, class_name=type(model).__name__)
    gm.meta["fxdebug_auto_leaves"] = list(auto_leaves)
    gm.meta["fxdebug_frontend"] = "fx"
    if auto_leaves:
        listed = "; ".join(f"{path} ({reason})" for path, reason in auto_leaves)
        warnings.warn(f"fxdebug traced {len(auto_leaves)} module(s) as leaves because tracing "
                      f"through them failed: {listed}. Their outputs are captured, their insides "
                      f"are not.", stacklevel=caller_stacklevel())
    return gm
