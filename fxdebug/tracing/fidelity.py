"""What plain torch.fx cannot see in a ``forward``, made visible while fxdebug traces.

torch.fx only records calls that receive a Proxy. Everything else runs once,
at trace time, and its result is frozen into the graph. :class:`TracePatches`
changes that for the cases where freezing changes what the model computes::

    with TracePatches(tracer, root):             around Tracer.trace, in the tracing thread
      ├─ _TracingMode, a TorchFunctionMode (per thread by design):
      │    ├─ torch.rand(3), torch.ones(2), torch.tensor([...])  -> call_function nodes
      │    │     every random op torch tags ``nondeterministic_seeded`` and every tensor
      │    │     constructor (an aten op without tensor arguments), plus the constructors
      │    │     from Python data (tensor, as_tensor, asarray)
      │    └─ t.uniform_(), t.normal_() on a constant tensor      -> call_method nodes
      ├─ thread-checked patches (torch has no per-thread hook for these; in any other
      │  thread each one calls the original at once):
      │    ├─ torch.no_grad / enable_grad / set_grad_enabled     -> grad-mode nodes,
      │    │     ``torch._C._set_grad_enabled``, restoring the mode read at run time
      │    ├─ torch.autocast(...)                                -> torch.amp._enter_autocast /
      │    │                                                        _exit_autocast nodes
      │    ├─ torch.from_numpy(array)                            -> a node on the array
      │    ├─ torch.inference_mode()                             -> UnfaithfulTrace: the module
      │    │                                                        runs eagerly (auto-leaf / parts)
      │    ├─ MyFunction.apply(<traced value>), a custom          -> UnfaithfulTrace: fx would
      │    │     torch.autograd.Function                             keep its forward only
      │    └─ self.attr = <traced value>                         -> UnfaithfulTrace
      │          (fx would leave a Proxy on the module)
      └─ re-tracing a GraphModule (torch.load, fxdebug.trace(gm)): its grad-mode and
            autocast calls stay nodes

    after the trace: take_leftover_proxies(root)   self.history.append(x) left a Proxy in
                                                   module state: removed, and UnfaithfulTrace

Nothing patched outlives the trace, not even in torch's caches: before the
patches go in, ``torch.overrides``' caches are filled with torch's own
functions, and after they are out every torch cache filled meanwhile that kept
a patch is emptied (:mod:`.torch_caches`).

torch.fx itself patches ``nn.Module.__call__`` and ``__getattr__`` for the whole
process while it traces, so traces run one at a time (:data:`TRACE_LOCK`); the
tracer hands other threads' module calls straight to their ``forward``. The
grad-mode and autocast nodes are the ones ``torch.export`` emits, and torch
keeps them through dead-code elimination.

>>> import threading
>>> class Noise(torch.nn.Module):
...     def forward(self, x):
...         elsewhere = threading.Thread(target=lambda: seen.append(type(torch.rand(2))))
...         elsewhere.start(); elsewhere.join()      # another thread, mid-trace
...         return x + torch.rand(3)
>>> seen, model, tracer = [], Noise(), fx.Tracer()
>>> with TracePatches(tracer, model):
...     graph = tracer.trace(model)
>>> [getattr(node.target, "__name__", node.target) for node in graph.nodes], seen
(['x', 'rand', 'add', 'output'], [<class 'torch.Tensor'>])
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from ..base import torch_compat
from ..runtime.inplace_ops import writes_in_place
from ..base.torch_compat import tree_leaves
from .function_watch import watching_functions
from .torch_caches import CacheWatch, warm_overrides

__all__ = ["TracePatches", "UnfaithfulTrace", "traced_torch_functions", "traced_tensor_methods",
           "static_forward", "take_leftover_proxies", "constant_value", "NOT_CONSTANT",
           "TRACE_LOCK", "real_values", "tracing_here"]

# Tensors built from Python data: not aten operators, so no schema says they construct.
_DATA_CONSTRUCTORS = ("tensor", "as_tensor", "asarray")

TRACE_LOCK = threading.RLock()
"""Held while fxdebug traces: torch.fx patches ``nn.Module`` for the process, one trace at a time."""

_ABSENT = object()
_IS_GRAD_ENABLED = torch.is_grad_enabled  # taken at import, before a trace patches it
_local = threading.local()  # .stack: this thread's active TracePatches; .real: real_values depth


class UnfaithfulTrace(RuntimeError):
    """Raised under tracing where the graph would not compute what eager ``forward`` computes."""

    fxdebug_location: tuple[str, int] | None = None  # the user's line, where known


def _packet(name: str):
    packet = getattr(torch.ops.aten, name, None)
    return packet if torch_compat.is_op_packet(packet) else None


def _overloads(packet) -> list:
    return [getattr(packet, overload) for overload in packet.overloads()]


def _is_random(packet) -> bool:
    return any(torch.Tag.nondeterministic_seeded in op.tags for op in _overloads(packet))


def _is_constructor(packet) -> bool:
    """Some overload takes no tensor and returns one (aten's notion of a factory)."""
    for op in _overloads(packet):
        schema = torch_compat.op_schema(op)
        if (not any("Tensor" in str(arg.type) for arg in schema.arguments)
                and any("Tensor" in str(ret.type) for ret in schema.returns)):
            return True
    return False


@functools.lru_cache(maxsize=None)
def traced_torch_functions() -> tuple[str, ...]:
    """Names of the ``torch.*`` functions recorded as nodes even when no argument is traced.

    >>> names = traced_torch_functions()
    >>> all(name in names for name in ("rand", "randn", "randint", "randperm", "bernoulli",
    ...                                "ones", "zeros", "arange", "tensor"))
    True
    """
    names = []
    for name in sorted(dir(torch)):
        value = getattr(torch, name, None)
        if name.startswith("_") or not callable(value) or isinstance(value, type):
            continue
        packet = _packet(name)
        if name in _DATA_CONSTRUCTORS or (packet is not None and (_is_random(packet)
                                                                   or _is_constructor(packet))):
            names.append(name)
    return tuple(names)


@functools.lru_cache(maxsize=None)
def traced_tensor_methods() -> tuple[str, ...]:
    """Names of random ``Tensor`` methods recorded as nodes when called on a constant tensor.

    >>> "uniform_" in traced_tensor_methods() and "normal_" in traced_tensor_methods()
    True
    """
    return tuple(name for name in sorted(dir(torch.Tensor))
                 if not name.startswith("_") and _packet(name) is not None
                 and _is_random(_packet(name)))


@functools.lru_cache(maxsize=None)
def _traced_callables() -> dict:
    """What :class:`_TracingMode` records, by the callable torch hands it."""
    found: dict = {getattr(torch, name): ("call_function", getattr(torch, name))
                   for name in traced_torch_functions()}
    found.update({getattr(torch.Tensor, name): ("call_method", name)
                  for name in traced_tensor_methods()})
    return found


def _holds_proxy(value) -> bool:
    return any(isinstance(leaf, fx.Proxy) for leaf in tree_leaves(value))


def static_forward(module: torch.nn.Module):
    """The function behind a ``@staticmethod forward``, or None for an ordinary forward.

    >>> class Twice(torch.nn.Module):
    ...     @staticmethod
    ...     def forward(x):
    ...         return 2 * x
    >>> static_forward(Twice()) is Twice.forward, static_forward(torch.nn.ReLU())
    (True, None)
    """
    for cls in type(module).__mro__:
        if "forward" in cls.__dict__:
            found = cls.__dict__["forward"]
            return found.__func__ if isinstance(found, staticmethod) else None
    return None


def tracing_here() -> "TracePatches | None":
    """The TracePatches of the trace running in this thread (None: run the original code).

    >>> tracing_here() is None
    True
    """
    stack = getattr(_local, "stack", None)
    if not stack or getattr(_local, "real", False):  # .real: a depth, 0 when not set
        return None
    return stack[-1]


@contextlib.contextmanager
def real_values():
    """Inside a trace, run torch as eager does (values Python needs now, e.g. a constant).

    >>> with real_values():
    ...     torch.ones(1).tolist()
    [1.0]
    """
    _local.real = getattr(_local, "real", 0) + 1
    try:
        yield
    finally:
        _local.real -= 1


class _TracingMode(TorchFunctionMode):
    """Random ops, constructors and grad-mode calls without a traced argument -> nodes."""

    def __init__(self, patches: "TracePatches") -> None:
        super().__init__()
        self.patches = patches

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        patches = tracing_here()
        if patches is self.patches:
            tracer = patches.tracer
            if func is torch_compat.SET_GRAD_ENABLED or (
                    patches.generated_code and func in torch_compat.AUTOCAST_NODE_FUNCTIONS):
                return tracer.create_proxy("call_function", func, args, kwargs)
            traced = _traced_callables().get(func)
            if traced is not None and not _holds_proxy((args, kwargs)):
                kind, target = traced
                return tracer.create_proxy(kind, target, args, kwargs)
        return func(*args, **kwargs)


class TracePatches:
    """While tracing: record as nodes what torch.fx would freeze or drop (see the module doc).

    Only the thread that entered it is affected: the TorchFunctionMode is per
    thread, and every patch calls the original in any other thread.
    """

    def __init__(self, tracer: fx.Tracer, root) -> None:
        self.tracer = tracer
        self.root = root
        self.generated_code = isinstance(root, (fx.GraphModule, torch_compat.CODE_ONLY_MODULE))
        self._mode = _TracingMode(self)

    def __enter__(self) -> "TracePatches":
        TRACE_LOCK.acquire()
        try:
            _install_patches()
            stack = getattr(_local, "stack", None)
            if stack is None:
                stack = _local.stack = []
            stack.append(self)
            try:
                self._functions = watching_functions(_refuse_traced_function)
                self._functions.__enter__()
                try:
                    self._mode.__enter__()
                except BaseException:
                    self._functions.__exit__(None, None, None)
                    raise
            except BaseException:
                stack.pop()
                raise
        except BaseException:
            _uninstall_patches()
            TRACE_LOCK.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            try:
                self._mode.__exit__(*exc)
            finally:
                self._functions.__exit__(None, None, None)
        finally:
            _local.stack.pop()
            _uninstall_patches()
            TRACE_LOCK.release()


# -- the thread-checked patches: installed while any trace runs (under TRACE_LOCK) ---------

_installed = [0]
_undo: list[tuple[object, str, object]] = []
_patched: dict[int, tuple[object, object]] = {}  # id(patch) -> (patch, torch's original)
_watch: list[CacheWatch] = []


def _set(owner, name: str, value) -> None:
    _undo.append((owner, name, vars(owner).get(name, _ABSENT)))
    _patched[id(value)] = (value, getattr(owner, name))
    setattr(owner, name, value)


def _refuse_traced_function(cls, args, kwargs) -> None:
    """While fxdebug traces: a custom Function applied to a traced value stops the trace."""
    if tracing_here() is not None and _holds_proxy((args, kwargs)):
        raise UnfaithfulTrace(
            f"fxdebug: the custom autograd Function {cls.__module__}.{cls.__qualname__} is "
            f"called on a traced value: a torch.fx graph would hold its forward and lose its "
            f"backward")


def _install_patches() -> None:
    _installed[0] += 1
    if _installed[0] > 1:
        return
    try:
        warm_overrides()  # torch's caches hold torch's functions, never the patches below
        _watch[:] = [CacheWatch()]
        _patch_grad_modes()
        _patch_autocast()
        original_is_grad_enabled = torch.is_grad_enabled

        def is_grad_enabled():
            here = tracing_here()
            if here is None or not here.generated_code:  # fxdebug's own generated code only
                return original_is_grad_enabled()
            return here.tracer.create_proxy("call_function", original_is_grad_enabled, (), {})

        _set(torch, "is_grad_enabled", functools.wraps(original_is_grad_enabled)(is_grad_enabled))
        original_from_numpy = torch.from_numpy  # no TorchFunctionMode sees it

        def from_numpy(array):
            here = tracing_here()
            if here is None:
                return original_from_numpy(array)
            return here.tracer.create_proxy("call_function", original_from_numpy, (array,), {})

        _set(torch, "from_numpy", functools.wraps(original_from_numpy)(from_numpy))
        inference_enter = torch.autograd.grad_mode.inference_mode.__enter__

        def refuse_inference_mode(self):
            if tracing_here() is None:
                return inference_enter(self)
            raise UnfaithfulTrace("fxdebug: torch.inference_mode() inside forward cannot be put "
                                  "into a torch.fx graph (its tensors differ from no_grad ones)")

        _set(torch.autograd.grad_mode.inference_mode, "__enter__", refuse_inference_mode)
        _set(torch.nn.Module, "__setattr__", _checked_setattr(torch.nn.Module.__setattr__))
    except BaseException:
        _uninstall_patches()
        raise


def _uninstall_patches() -> None:
    _installed[0] -= 1
    if _installed[0] > 0:
        return
    _installed[0] = 0
    while _undo:
        owner, name, original = _undo.pop()
        if original is _ABSENT:
            delattr(owner, name)  # inherited: the base class's attribute shows again
        else:
            setattr(owner, name, original)
    if _watch:  # a cache torch filled meanwhile with a patch: emptied, torch refills it
        _watch.pop().repair(_patched)
    _patched.clear()


def _patch_grad_modes() -> None:
    grad_mode = torch.autograd.grad_mode

    def read_mode(tracer):
        return tracer.create_proxy("call_function", _IS_GRAD_ENABLED, (), {})

    def set_mode(tracer, mode):
        tracer.create_proxy("call_function", torch_compat.SET_GRAD_ENABLED, (mode,), {})

    def enter_fixed(cls, mode):
        original = vars(cls)["__enter__"] if "__enter__" in vars(cls) else cls.__enter__

        def __enter__(self):
            here = tracing_here()
            if here is None:
                return original(self)
            self.prev = read_mode(here.tracer)
            set_mode(here.tracer, mode)
        return __enter__

    def exit_for(cls):
        original = cls.__exit__

        def __exit__(self, *exc):
            here = tracing_here()
            if here is None or not isinstance(getattr(self, "prev", None), fx.Proxy):
                return original(self, *exc)
            set_mode(here.tracer, self.prev)
        return __exit__

    set_grad = grad_mode.set_grad_enabled
    set_init, set_enter = set_grad.__init__, set_grad.__enter__

    def init(self, mode):
        here = tracing_here()
        if here is None:
            return set_init(self, mode)
        self.prev = read_mode(here.tracer)
        set_mode(here.tracer, mode)
        self.mode = mode

    def enter(self):
        here = tracing_here()
        if here is None or not isinstance(getattr(self, "prev", None), fx.Proxy):
            return set_enter(self)
        set_mode(here.tracer, self.mode)

    for cls, mode in ((grad_mode.no_grad, False), (grad_mode.enable_grad, True)):
        exit_ = exit_for(cls)
        _set(cls, "__enter__", enter_fixed(cls, mode))
        _set(cls, "__exit__", exit_)
    set_exit = exit_for(set_grad)
    _set(set_grad, "__init__", init)
    _set(set_grad, "__enter__", enter)
    _set(set_grad, "__exit__", set_exit)


def _patch_autocast() -> None:
    autocast = torch.amp.autocast_mode.autocast
    original_enter, original_exit = autocast.__enter__, autocast.__exit__

    def __enter__(self):
        here = tracing_here()
        if here is None:
            return original_enter(self)
        values = torch_compat.autocast_arguments(self)
        self._fxdebug_mode = here.tracer.create_proxy(
            "call_function", torch_compat.ENTER_AUTOCAST, values, {})
        return self

    def __exit__(self, *exc):
        here = tracing_here()
        if here is None or "_fxdebug_mode" not in vars(self):
            return original_exit(self, *exc)
        here.tracer.create_proxy("call_function", torch_compat.EXIT_AUTOCAST,
                                 (vars(self).pop("_fxdebug_mode"),), {})
        return False

    _set(autocast, "__enter__", __enter__)
    _set(autocast, "__exit__", __exit__)


def _checked_setattr(original):
    def __setattr__(self, name, value):
        if tracing_here() is not None and _holds_proxy(value):
            raise UnfaithfulTrace(
                f"fxdebug: forward stores a traced value on the module (self.{name} = ...): "
                f"torch.fx would leave a Proxy in {type(self).__name__}.{name}")
        original(self, name, value)

    return __setattr__


def take_leftover_proxies(root: torch.nn.Module) -> list[tuple[str, str, fx.Node]]:
    """Take Proxies a traced ``forward`` left in module state out again; say where they were.

    ``self.history.append(x)`` or ``self.seen[k] = x`` under tracing leaves a Proxy
    in a list or dict of the module (the user's own: submodules are shared). They
    are removed, and ``(module path, attribute, node)`` returned for each.

    >>> class Keeps(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.history = []
    ...     def forward(self, x):
    ...         self.history.append(x * 2)
    ...         return x
    >>> model = Keeps()
    >>> _ = fx.symbolic_trace(model)
    >>> [(path, name, node.name) for path, name, node in take_leftover_proxies(model)], model.history
    ([('', 'history', 'mul')], [])
    """
    found = []
    for path, module in root.named_modules():
        state = module.__dict__
        # torch.nn's own state (_parameters, _modules, hook dicts, ...) holds no Proxies
        holders = [name for name, value in state.items() if isinstance(value, _HOLDERS)
                   and not (isinstance(value, dict) and name.startswith("_"))]
        for name in holders:
            value = state[name]
            if isinstance(value, fx.Proxy):
                found.append((path, name, value.node))
                del state[name]
            elif isinstance(value, list):
                proxies = [item for item in value if isinstance(item, fx.Proxy)]
                if proxies:
                    value[:] = [item for item in value if not isinstance(item, fx.Proxy)]
                    found.extend((path, name, proxy.node) for proxy in proxies)
            else:
                for key in [k for k, item in value.items() if isinstance(item, fx.Proxy)]:
                    found.append((path, name, value.pop(key).node))
    return found


_HOLDERS = (fx.Proxy, list, dict)


NOT_CONSTANT = object()


def _is_random_target(node: fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    packet = _packet(str(name).strip("_") if str(name).startswith("__") else str(name))
    return packet is not None and _is_random(packet)


def constant_value(node: fx.Node, root: torch.nn.Module):
    """The value of ``node`` when it is computed from constants only, else ``NOT_CONSTANT``.

    What Python needs a real value of while tracing (``if torch.tensor(3) > 2``,
    ``range(torch.arange(4).numel())``) is computed as eager computes it, once, as
    plain torch.fx did: a constructor's result stays a node for the graph, but a
    branch on it is not a branch on the inputs. Not constant: anything reached
    from an input, a parameter, a module call, a random op, or a value written
    in place by a node outside this computation.

    >>> graph, root = fx.Graph(), torch.nn.Module()
    >>> four = graph.call_function(torch.tensor, (4.0,))
    >>> constant_value(graph.call_method("sqrt", (four,)), root)
    tensor(2.)
    >>> constant_value(graph.placeholder("x"), root) is NOT_CONSTANT
    True
    """
    ancestors: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if current in ancestors:
            continue
        if current.op in ("placeholder", "call_module", "output") or _is_random_target(current):
            return NOT_CONSTANT
        if current.op == "get_attr" and not str(current.target).startswith("_tensor_constant"):
            return NOT_CONSTANT  # a parameter or buffer: training may change it
        ancestors[current] = None
        stack.extend(current.all_input_nodes)
    if any(writes_in_place(user) and user not in ancestors
           for ancestor in ancestors for user in ancestor.users):
        return NOT_CONSTANT
    values: dict[fx.Node, Any] = {}
    for current in node.graph.nodes:  # graph order: in-place writes happen as in eager
        if current not in ancestors:
            continue
        args = fx.node.map_arg(current.args, values.__getitem__)
        kwargs = fx.node.map_arg(current.kwargs, values.__getitem__)
        if current.op == "get_attr":
            values[current] = getattr(root, current.target)
        elif current.op == "call_method":
            values[current] = getattr(args[0], current.target)(*args[1:], **kwargs)
        else:
            values[current] = current.target(*args, **kwargs)
    return values[node]
