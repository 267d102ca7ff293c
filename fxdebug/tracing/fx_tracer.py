"""The fx front end: a faithful symbolic trace with stable keys and user source lines.

Call tree::

    trace_fx(model, leaf_modules, concrete_args, auto_leaf)
      ├─ ModelSnapshot(model)                      put back after every attempt (transaction.py)
      └─ for each attempt (one more auto-leaf per failed attempt)
           ├─ _Tracer.trace(shallow copy of model)   torch.fx.Tracer, plus:
           │    ├─ create_node   -> meta: fxdebug_key, fxdebug_source
           │    ├─ call_module   -> scope stack; non-leaf outputs -> fxdebug_returns; forward
           │    │                   hooks -> run-time nodes around the body (module_hooks.py)
           │    ├─ proxy         -> _FaithfulProxy (keeps ``+=`` and ``x[i] = v`` in place)
           │    └─ TracePatches  -> random ops / constructors / grad modes / autocast as
           │                        nodes; inference_mode, ``self.x = proxy`` refused (fidelity.py)
           ├─ take_leftover_proxies: a Proxy kept in module state -> that module is refused
           ├─ lower_inplace_operators: ``x += y`` that nothing can observe -> ``x + y``
           └─ on failure: explain_failure() -> TraceFailure
                 └─ auto_leaf and the failure is inside a submodule: retry with it as a leaf
      └─ DebugGraphModule(root, graph)      code generated on first use

Plain ``torch.fx.symbolic_trace`` rewrites ``v += 1`` on a traced tensor into
``v = v + 1``: a view of the input is no longer written through, so the traced
model computes different numbers than eager. fxdebug's proxies keep augmented
assignments in place (``operator.iadd``; fx prints it as ``v += 1``), then
lowers those nobody can tell from ``v = v + 1`` to ``operator.add`` (resnet's
``out += identity``; see inplace_lowering.py), so passes written for plain fx
find the ``operator.add`` they look for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import sys
import threading
import warnings
from typing import Iterable

import torch
import torch.fx as fx
from torch.fx.proxy import Attribute

from ..errors import EagerFallbackWarning, FidelityWarning
from ..runtime import PROXY_IN_TEXT, ROOT_HOOKS_ATTR, HookedRoot, Recorder, leaves, traced_message
from ..base import torch_compat
from ..runtime.inplace_ops import INPLACE_NAMES
from .failure import explain_failure
from .fidelity import (NOT_CONSTANT, TracePatches, UnfaithfulTrace, constant_value, real_values,
                       static_forward, take_leftover_proxies)
from .graph_module import lazy_graph_module
from .inplace_lowering import lower_inplace_operators
from .keys import (META_KEY, META_MODULE, META_RETURNS, META_SOURCE, KeyAllocator, ModuleReturn,
                   key_base)
from .locations import caller_stacklevel, short_list, user_location
from .module_copy import shallow_module_copy
from .root_signature import named_parameters_forward, optional_inputs
from .transaction import ModelSnapshot
from .module_hooks import check_root_reads, hooked_forward, runs_hooks_in_graph, runs_whole

__all__ = ["trace_fx"]

log = logging.getLogger("fxdebug")


class _InplaceMixin:
    """Augmented assignment and item assignment recorded as in-place graph nodes; a value
    computed from constants only is given to Python when it needs a number."""

    def __getattr__(self, name):
        return _FaithfulAttribute(self, name)

    def _concrete(self, convert, kind):
        value = self.tracer.concrete(self) if isinstance(self.tracer, _Tracer) else NOT_CONSTANT
        if value is NOT_CONSTANT:
            raise TypeError(f"{kind} argument must be a number, not Proxy "
                            f"(a traced value used as a Python number)")
        return convert(value)

    def __index__(self):
        return self._concrete(operator.index, "__index__")

    def __int__(self):
        return self._concrete(int, "int()")

    def __float__(self):
        return self._concrete(float, "float()")

    def __len__(self):
        value = self.tracer.concrete(self) if isinstance(self.tracer, _Tracer) else NOT_CONSTANT
        if value is NOT_CONSTANT:
            return super().__len__()
        return len(value)

    def __setitem__(self, index, value):
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})


def _make_inplace(name: str):
    target = getattr(operator, name)

    def method(self, other):
        return self.tracer.create_proxy("call_function", target, (self, other), {})

    method.__name__ = f"__{name}__"
    return method


for _name in INPLACE_NAMES:
    setattr(_InplaceMixin, f"__{_name}__", _make_inplace(_name))


class _FaithfulAttribute(_InplaceMixin, Attribute):
    pass


class _FaithfulProxy(_InplaceMixin, fx.Proxy):
    pass


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
        # not `self.keys`: that is torch.fx.Tracer.keys, which `**proxy` calls
        self.key_allocator = KeyAllocator()  # re-made with the root's module paths in trace()
        self.failure_scope: tuple[str, ...] | None = None
        self.condition_node: fx.Node | None = None
        self._order: dict[fx.Node, int] = {}
        self._recorder_proxies: dict[str, fx.Proxy] = {}
        self._thread = threading.get_ident()
        self.key_override = None  # module_hooks.fixed_keys: a hook node's key
        self.hooks_owner: torch.nn.Module | None = None  # the model whose root hooks to run
        self._root_hooks = False
        self.keywords: tuple = ()  # a call's **kwargs names, traced as named inputs

    def trace(self, root, concrete_args=None):
        self.condition_node = None
        self._thread = threading.get_ident()
        if not isinstance(root, torch.nn.Module):
            with TracePatches(self, root):
                return super().trace(root, concrete_args)
        self.key_allocator = KeyAllocator(owned=(name for name, _ in root.named_modules() if name))
        static = static_forward(root)
        owner = self.hooks_owner
        self._root_hooks = static is None and owner is not None and runs_hooks_in_graph(owner)
        with TracePatches(self, root):
            if static is None:
                graph = super().trace(root, concrete_args)
                if self._root_hooks and owner is not None:
                    # the graph runs the model's own hooks; set after tracing, so forward never
                    # sees it (Sequential iterates its children); root is the caller's copy
                    setattr(root, ROOT_HOOKS_ATTR, HookedRoot(owner))
                    check_root_reads(graph, owner)
                return graph
            # fx would bind the module to the first parameter: trace the function instead
            graph = super().trace(static, concrete_args)
        for node in graph.nodes:  # constants fx stored on its stand-in root
            if node.op == "get_attr":
                setattr(root, node.target, getattr(self.root, node.target))
        self.root = root
        return graph

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        if self.keywords or concrete_args is not None or not optional_inputs(root_fn):
            # a decorated forward (every HF model's) with its own parameters; where some are
            # optional (None), only with concrete_args saying which are given (fx would take
            # `labels is not None` as true, and the graph would need labels)
            root_fn = named_parameters_forward(root_fn, self.keywords)
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        if not self._root_hooks:
            return fn, args
        head = 1 if is_module else 0  # the module itself, then the placeholders

        @functools.wraps(fn)
        def with_root_hooks(*values):
            def body(*inputs, **kw):
                return fn(*values[:head], *inputs, **kw)
            return hooked_forward(self, ROOT_HOOKS_ATTR, "", body)(*values[head:])
        return with_root_hooks, args

    def to_bool(self, obj):
        value = self.concrete(obj)
        if value is not NOT_CONSTANT:
            return bool(value)
        self.condition_node = obj.node  # what the failing branch depends on (failure.py)
        return super().to_bool(obj)

    def iter(self, obj):
        value = self.concrete(obj)
        if value is not NOT_CONSTANT:
            return iter(value)
        self.condition_node = obj.node
        return super().iter(obj)

    def concrete(self, obj):
        """The value of a Proxy computed from constants only (a constructor's result), or
        NOT_CONSTANT: Python needs it now, and it is the same on every run."""
        if not isinstance(obj, fx.Proxy) or obj.tracer is not self:
            return NOT_CONSTANT
        with real_values():
            return constant_value(obj.node, self.root)

    def create_arg(self, a):
        if type(a).__module__ == "numpy" and type(a).__name__ == "ndarray":
            # torch.from_numpy(array) stays a call on the array, as in eager: the array is
            # kept as a tensor constant sharing its memory, handed back with .numpy()
            with real_values():  # the patched torch.from_numpy calls the original
                shared = super().create_arg(torch.from_numpy(a))
            return self.create_node("call_method", "numpy", (shared,), {})
        if isinstance(a, dict) and type(a) is not dict and dataclasses.is_dataclass(a) and all(
                isinstance(name, str) and name.isidentifier() for name in a):
            # a dataclass that is a dict (HF's ModelOutput): built again by the graph, as
            # forward built it; torch.fx alone would hand back a plain dict
            return self.create_node("call_function", type(a), (),
                                    {name: self.create_arg(value) for name, value in a.items()})
        return super().create_arg(a)

    # -- graph construction ----------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _FaithfulProxy(node, self)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        if kind == "call_function" and target is torch._assert:
            args = self._message_of_this_run(args)
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        scope = self._module_scope[-1] if self._module_scope else ""
        node.meta[META_KEY] = self.key_override(node) if self.key_override is not None else \
            self.key_allocator.allocate(key_base(kind, target, scope), owner=kind == "call_module")
        node.meta[META_SOURCE] = user_location(sys._getframe(1))
        node.meta[META_MODULE] = str(target) if kind == "call_module" else scope
        self._order[node] = len(self._order)
        return node

    def _message_of_this_run(self, args: tuple) -> tuple:
        """``torch._assert(cond, f"... {proxy}")``: a message node that formats the run's values."""
        if len(args) < 2 or not isinstance(args[1], str):
            return args
        by_name = {node.name: node for node in self.graph.nodes}
        names = tuple(dict.fromkeys(name for name in PROXY_IN_TEXT.findall(args[1])
                                    if name in by_name))
        if not names:
            return args
        message = self.create_node("call_function", traced_message,
                                   (args[1], names, tuple(by_name[name] for name in names)), {})
        return (args[0], message) + tuple(args[2:])

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or isinstance(m, self.leaf_types):
            return True
        if runs_whole(m):  # backward hooks: only module(...) runs them as eager does
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self._thread:  # torch.fx patched nn.Module for every thread
            return attr_val
        if isinstance(attr_val, Recorder):
            # One get_attr node for the recorder when a GraphModule is re-traced.
            if attr not in self._recorder_proxies:
                self._recorder_proxies[attr] = self.create_proxy("get_attr", attr, (), {})
            return self._recorder_proxies[attr]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self._thread:  # another thread's module: runs as in eager
            return forward(*args, **kwargs)
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        source = user_location(sys._getframe(1))
        key = self.key_allocator.allocate(path, owner=True)
        self._module_scope.append(path)
        if runs_hooks_in_graph(m):  # its hooks run at run time, around its traced forward
            forward = hooked_forward(self, path, key, m.forward)
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
        proxies = leaves(out, is_leaf=lambda value: isinstance(value, fx.Proxy))
        items = [(subpath, proxy.node) for subpath, proxy in proxies
                 if isinstance(proxy.node, fx.Node) and proxy.node.graph is self.graph]
        if not items or not self._order:
            return
        # The module's output is complete when its last node has run.
        end = max(self._order, key=self._order.__getitem__)
        record = ModuleReturn(key, module_type, tuple((s, n.name) for s, n in items), source)
        end.meta.setdefault(META_RETURNS, []).append(record)


def _share_parameters(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """The graph reads parameters as ``model`` holds them when it runs, not as they were
    when it was traced: the root and every module fx made a stand-in for (to hold a
    ``get_attr`` target of a traced-through module) share their module's parameter registry.
    FSDP2's hooks swap in gathered parameters before each forward (a ViT's ``cls_token``,
    its final ``norm``, owned by the root's group) and the sharded ones back after."""
    originals = dict(model.named_modules(remove_duplicate=False))
    for path, module in gm.named_modules(remove_duplicate=False):
        original = originals.get(path)
        if original is not None and original is not module:
            torch_compat.share_parameters(module, original)


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


def _refuse_leftover_proxies(tracer: _Tracer, root: torch.nn.Module) -> None:
    """A Proxy kept in module state (``self.history.append(x)``): that module runs eagerly."""
    leftover = take_leftover_proxies(root)
    if not leftover:
        return
    path, name, node = leftover[0]
    parts = path.split(".") if path else []
    tracer.failure_scope = tuple(".".join(parts[:i + 1]) for i in range(len(parts)))
    error = UnfaithfulTrace(f"fxdebug: forward stores a traced value on the module (in "
                            f"self.{name}, {type(root.get_submodule(path)).__name__}): torch.fx "
                            f"would leave a Proxy there")
    error.fxdebug_location = node.meta.get(META_SOURCE)
    raise error


def _refuse_attributes_made_while_tracing(tracer: _Tracer, graph: fx.Graph,
                                          root: torch.nn.Module) -> None:
    """A ``get_attr`` node whose target a ``forward`` registered while it was traced (put back
    since): that module runs eagerly, where it registers it for real."""
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = str(node.target).rpartition(".")
        try:
            owner = root.get_submodule(owner_path)
        except AttributeError:
            owner = None
        if owner is not None and hasattr(owner, name):
            continue
        parts = owner_path.split(".") if owner_path else []
        tracer.failure_scope = tuple(".".join(parts[:i + 1]) for i in range(len(parts)))
        error = UnfaithfulTrace(f"fxdebug: forward registers {node.target!r} on the module while "
                                f"it runs (a lazily made parameter or buffer)")
        error.fxdebug_location = node.meta.get(META_SOURCE)
        raise error


def _warn_lost(lost: list[str], model: torch.nn.Module) -> None:
    if lost:
        warnings.warn(f"fxdebug.trace ran {type(model).__name__}'s forward and hooks on traced "
                      f"values, and they changed what fxdebug cannot put back: "
                      f"{short_list(lost)}. Check these before training on.", FidelityWarning,
                      stacklevel=caller_stacklevel())


def trace_fx(model: torch.nn.Module, leaf_modules: Iterable = (),
             concrete_args: dict | None = None, auto_leaf: bool = True,
             warn: bool = True, root_hooks: bool = True,
             snapshot: ModelSnapshot | None = None, keywords: tuple = ()) -> fx.GraphModule:
    """Symbolic tracing with auto-leaf (the ``"fx"`` front end).

    ``warn=False``: auto-leaves are only listed in ``gm.meta["fxdebug_auto_leaves"]``
    (for a caller that reports them itself), not warned about. ``root_hooks=False``: the
    graph does not run ``model``'s own forward hooks (its caller calls ``model(...)``).
    ``snapshot``: ``model`` as it is now, if the caller has one (see
    :func:`fxdebug.frontend.trace_in_transaction`); else one is taken. ``keywords``: names
    a call passes through forward's ``**kwargs``, traced as named inputs after the others
    (part-by-part tracing specialises a call so).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxdebug.trace expects an nn.Module, got {type(model).__name__}. "
                        f"Wrap a plain function in a Module, or call torch.fx.symbolic_trace on it.")
    leaf_paths, leaf_types = _resolve_leaves(model, leaf_modules)
    auto_leaves: list[tuple[str, str]] = []
    # forward and its hooks run on Proxies, and what they write on the user's objects (an
    # attribute, FSDP's lazy init, fx's Proxy for a parameter read by a hook) is put back
    before = ModelSnapshot(model) if snapshot is None else snapshot
    while True:
        tracer = _Tracer(leaf_paths + [path for path, _ in auto_leaves], leaf_types)
        tracer.hooks_owner = model if root_hooks else None
        tracer.keywords = tuple(keywords)
        # fx writes tensor constants onto the traced root: a shallow copy keeps them off the
        # user's module, while submodules stay shared as in torch.fx (model.eval() reaches gm)
        root = shallow_module_copy(model)
        try:
            try:
                graph = tracer.trace(root, concrete_args=concrete_args)
                _refuse_leftover_proxies(tracer, root)
            finally:
                _warn_lost(before.restore(), model)
            _refuse_attributes_made_while_tracing(tracer, graph, root)
            break
        except Exception as exc:  # any failure of user code under tracing is explained
            failure = explain_failure(exc, model, tracer.failure_scope or (), tuple(auto_leaves),
                                      tracer.condition_node)
            can_retry = (auto_leaf and failure.module_path
                         and failure.module_path not in leaf_paths
                         and failure.module_path not in [p for p, _ in auto_leaves])
            if not can_retry:
                raise failure from exc
            reason = f"{failure.kind} at {failure.location}"
            log.info("auto-leaf: %s (%s): %s", failure.module_path, failure.module_type, reason)
            auto_leaves.append((failure.module_path, reason))
    lower_inplace_operators(graph, root)
    gm = lazy_graph_module(root, graph, type(model).__name__)  # code generated on first use
    _share_parameters(gm, model)
    gm.meta["fxdebug_auto_leaves"] = list(auto_leaves)
    gm.meta["fxdebug_frontend"] = "fx"
    if auto_leaves and warn:
        listed = short_list([f"{path} ({reason})" for path, reason in auto_leaves])
        warnings.warn(f"fxdebug traced {len(auto_leaves)} module(s) as leaves (tracing through "
                      f"them failed): {listed}; they run eagerly, captured as they run, and "
                      f"passes cannot edit their insides. gm.meta['fxdebug_auto_leaves'] says why.",
                      EagerFallbackWarning,
                      stacklevel=caller_stacklevel())
    return gm
