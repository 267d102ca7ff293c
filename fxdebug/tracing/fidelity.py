"""What plain torch.fx cannot see in a ``forward``, made visible while fxdebug traces.

torch.fx only records calls that receive a Proxy. Everything else runs once,
at trace time, and its result is frozen into the graph. :class:`TracePatches`
changes that for the cases where freezing changes what the model computes::

    with TracePatches(tracer, root):             around Tracer.trace
      ├─ torch.rand(3), torch.ones(2), torch.tensor([...])   -> call_function nodes
      │     every random op torch tags ``nondeterministic_seeded`` and every
      │     tensor constructor (an aten op without tensor arguments), plus the
      │     constructors from Python data (tensor, as_tensor, asarray, from_numpy)
      ├─ t.uniform_(), t.normal_() on a constant tensor        -> call_method nodes
      ├─ torch.no_grad / enable_grad / set_grad_enabled        -> grad-mode nodes
      │     ``torch._C._set_grad_enabled``, restoring the mode read at run time
      ├─ torch.autocast(...)                                   -> torch.amp._enter_autocast /
      │                                                           _exit_autocast nodes
      ├─ torch.inference_mode()                                -> UnfaithfulTrace: the module
      │                                                           runs eagerly (auto-leaf / parts)
      ├─ self.attr = <traced value>                            -> UnfaithfulTrace
      │     (fx would leave a Proxy on the module)
      └─ re-tracing a GraphModule (torch.load, fxdebug.trace(gm)): its grad-mode and
            autocast calls stay nodes

    after the trace: take_leftover_proxies(root)   self.history.append(x) left a Proxy in
                                                   module state: removed, and UnfaithfulTrace

The grad-mode and autocast nodes are the ones ``torch.export`` emits, and
torch keeps them through dead-code elimination
(``torch.fx.node._side_effectful_functions``).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.graph_module import _CodeOnlyModule  # what torch.load re-traces

__all__ = ["TracePatches", "UnfaithfulTrace", "traced_torch_functions", "traced_tensor_methods",
           "static_forward", "take_leftover_proxies", "constant_value", "NOT_CONSTANT",
           "UNPATCHED_FROM_NUMPY"]

# Tensors built from Python data: not aten operators, so no schema says they construct.
_DATA_CONSTRUCTORS = ("tensor", "as_tensor", "asarray", "from_numpy")


_ABSENT = object()
UNPATCHED_FROM_NUMPY = torch.from_numpy  # taken at import, before any trace patches it


class UnfaithfulTrace(RuntimeError):
    """Raised under tracing where the graph would not compute what eager ``forward`` computes."""


def _packet(name: str):
    packet = getattr(torch.ops.aten, name, None)
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _overloads(packet) -> list:
    return [getattr(packet, overload) for overload in packet.overloads()]


def _is_random(packet) -> bool:
    return any(torch.Tag.nondeterministic_seeded in op.tags for op in _overloads(packet))


def _is_constructor(packet) -> bool:
    """Some overload takes no tensor and returns one (aten's notion of a factory)."""
    for op in _overloads(packet):
        schema = op._schema
        if (not any("Tensor" in str(arg.type) for arg in schema.arguments)
                and any("Tensor" in str(ret.type) for ret in schema.returns)):
            return True
    return False


@functools.lru_cache(maxsize=None)
def traced_torch_functions() -> tuple[str, ...]:
    """Names of the ``torch.*`` functions recorded as nodes even when no argument is traced.

    >>> names = traced_torch_functions()
    >>> all(name in names for name in ("rand", "randn", "randint", "randperm", "bernoulli",
    ...                                "ones", "zeros", "arange", "tensor", "from_numpy"))
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


def _holds_proxy(value) -> bool:
    return any(isinstance(leaf, fx.Proxy) for leaf in pytree.tree_leaves(value))


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


class TracePatches:
    """While tracing: record as nodes what torch.fx would freeze or drop (see the module doc).

    >>> class Noise(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x + torch.rand(3)
    >>> model, tracer = Noise(), fx.Tracer()
    >>> with TracePatches(tracer, model):
    ...     graph = tracer.trace(model)
    >>> [getattr(node.target, "__name__", node.target) for node in graph.nodes]
    ['x', 'rand', 'add', 'output']
    """

    def __init__(self, tracer: fx.Tracer, root) -> None:
        self.tracer = tracer
        self.root = root
        self._undo: list[tuple[object, str, object, bool]] = []

    # -- installing ----------------------------------------------------------------------
    def __enter__(self) -> "TracePatches":
        try:
            originals: dict[int, object] = {}
            for name in traced_torch_functions():
                original = getattr(torch, name)
                originals[id(original)] = self._function(original)
                self._set(torch, name, originals[id(original)])
            for globals_ in self._forward_globals():  # `from torch import rand` in user files
                for name, value in list(globals_.items()):
                    if id(value) in originals and not name.startswith("_"):
                        self._set_item(globals_, name, originals[id(value)])
            for name in traced_tensor_methods():
                self._set(torch.Tensor, name, self._method(name, getattr(torch.Tensor, name)))
            self._patch_grad_modes()
            self._patch_autocast()
            if isinstance(self.root, (fx.GraphModule, _CodeOnlyModule)):  # generated code
                self._patch_mode_nodes()
            self._set(torch.autograd.grad_mode.inference_mode, "__enter__", _refuse_inference_mode)
            self._set(torch.nn.Module, "__setattr__", _checked_setattr(torch.nn.Module.__setattr__))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            owner, name, original, is_item = self._undo.pop()
            if is_item:
                owner[name] = original
            elif original is _ABSENT:
                delattr(owner, name)  # inherited: the base class's attribute shows again
            else:
                setattr(owner, name, original)

    def _set(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, vars(owner).get(name, _ABSENT), False))
        setattr(owner, name, value)

    def _set_item(self, mapping: dict, name: str, value) -> None:
        self._undo.append((mapping, name, mapping[name], True))
        mapping[name] = value

    def _forward_globals(self) -> list[dict]:
        found: dict[int, dict] = {}
        modules = self.root.modules() if isinstance(self.root, torch.nn.Module) else ()
        functions = [type(m).forward for m in modules]
        if not isinstance(self.root, torch.nn.Module):
            functions.append(self.root)
        for function in functions:
            function = inspect.unwrap(function)
            globals_ = getattr(function, "__globals__", None)
            if isinstance(globals_, dict) and globals_ is not vars(torch):
                found.setdefault(id(globals_), globals_)
        return list(found.values())

    # -- the replacements ----------------------------------------------------------------
    def _function(self, original):
        tracer = self.tracer

        @functools.wraps(original)
        def traced(*args, **kwargs):
            if _holds_proxy((args, kwargs)):
                return original(*args, **kwargs)  # torch.fx records it (__torch_function__)
            return tracer.create_proxy("call_function", original, args, kwargs)

        return traced

    def _method(self, name: str, original):
        tracer = self.tracer

        @functools.wraps(original)
        def traced(self, *args, **kwargs):
            if isinstance(self, fx.Proxy) or _holds_proxy((args, kwargs)):
                return original(self, *args, **kwargs)
            return tracer.create_proxy("call_method", name, (self, *args), kwargs)

        return traced

    def _patch_grad_modes(self) -> None:
        tracer = self.tracer
        grad_mode = torch.autograd.grad_mode

        def read_mode():
            return tracer.create_proxy("call_function", torch.is_grad_enabled, (), {})

        def set_mode(mode):
            tracer.create_proxy("call_function", torch._C._set_grad_enabled, (mode,), {})

        def enter_fixed(mode):
            def __enter__(self):
                self.prev = read_mode()
                set_mode(mode)
            return __enter__

        def exit_(self, *exc):
            set_mode(self.prev)

        def set_init(self, mode):
            self.prev = read_mode()
            set_mode(mode)
            self.mode = mode

        def set_enter(self):
            set_mode(self.mode)

        for cls, mode in ((grad_mode.no_grad, False), (grad_mode.enable_grad, True)):
            self._set(cls, "__enter__", enter_fixed(mode))
            self._set(cls, "__exit__", exit_)
        self._set(grad_mode.set_grad_enabled, "__init__", set_init)
        self._set(grad_mode.set_grad_enabled, "__enter__", set_enter)
        self._set(grad_mode.set_grad_enabled, "__exit__", exit_)

    def _patch_mode_nodes(self) -> None:
        """Re-tracing fxdebug's own generated code: its grad-mode and autocast calls stay nodes."""
        for owner, name in ((torch, "is_grad_enabled"), (torch._C, "_set_grad_enabled"),
                            (torch.amp.autocast_mode, "_enter_autocast"),
                            (torch.amp.autocast_mode, "_exit_autocast"),
                            (torch.amp, "_enter_autocast"), (torch.amp, "_exit_autocast")):
            original = vars(owner)[name]
            self._set(owner, name, self._always_node(original))

    def _always_node(self, original):
        tracer = self.tracer

        @functools.wraps(original)
        def traced(*args, **kwargs):
            return tracer.create_proxy("call_function", original, args, kwargs)

        return traced

    def _patch_autocast(self) -> None:
        tracer = self.tracer
        autocast = torch.amp.autocast_mode.autocast

        def __enter__(self):
            values = (self.device, self.fast_dtype, self._enabled, self._cache_enabled)
            self._fxdebug_mode = tracer.create_proxy("call_function", torch.amp._enter_autocast,
                                                     values, {})
            return self

        def __exit__(self, *exc):
            tracer.create_proxy("call_function", torch.amp._exit_autocast,
                                (self._fxdebug_mode,), {})
            return False

        self._set(autocast, "__enter__", __enter__)
        self._set(autocast, "__exit__", __exit__)


def _refuse_inference_mode(self):
    raise UnfaithfulTrace("fxdebug: torch.inference_mode() inside forward cannot be put into a "
                          "torch.fx graph (its tensors differ from no_grad ones)")


def _checked_setattr(original):
    def __setattr__(self, name, value):
        if _holds_proxy(value):
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
_INPLACE_FUNCTIONS = ("iadd", "iand", "ifloordiv", "ilshift", "imod", "imul", "imatmul", "ior",
                      "ipow", "irshift", "isub", "itruediv", "ixor", "setitem")


def _is_random_target(node: fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    packet = _packet(str(name).strip("_") if str(name).startswith("__") else str(name))
    return packet is not None and _is_random(packet)


def _writes_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _INPLACE_FUNCTIONS


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
    if any(_writes_in_place(user) and user not in ancestors
           for ancestor in ancestors for user in ancestor.users):
        return NOT_CONSTANT
    values: dict[fx.Node, object] = {}
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
