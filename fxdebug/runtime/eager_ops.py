"""Captures inside code that runs eagerly: module calls and, with ``capture="all"``, every op.

Parts of a model can run outside an fx graph: a module a part-by-part model
could not trace, an auto-leaf, a user's leaf module, a ``torch.nn`` module
with children (``TransformerEncoder``). fxdebug still captures what happens
in there, under the keys a traced graph would give it::

    EagerScope.region(path)                     an eager region starts
      ├─ entering it                             the op recorder (a TorchFunctionMode)
      │                                          is pushed once, for the outermost region
      │    model code: torch.matmul(q, k) ...    OpRecorder.__torch_function__: run the op,
      │                                          then capture its tensor output under
      │                                          "path.matmul", "path.matmul_1"...
      │    child module call                     EagerScope.module_call: its own scope, its
      │                                          output captured as "path.child" (per call:
      │                                          "path.child_1"...)
      │    child traced part                     EagerScope.paused(): the part's graph
      │                                          captures its own nodes
      └─ leaving it                              the mode is popped (also on an exception)

Keys come from an :class:`EagerKeys` made per Records, so a run numbers from
zero again: the n-th call of module ``path`` is ``path_n`` (as forward hooks
count calls), an op is ``base``, ``base_1``... as in a traced graph, never
taking a module's path or a name of one of its calls (``F.dropout`` next to
module ``dropout`` is ``dropout_op``). Op names are the names fx gives the same call
(``torch.matmul`` and ``Tensor.matmul`` -> ``matmul``, ``x + y`` -> ``add``).
Captured values are copies (eager code may write to them in place later);
each record says ``via="eager op"`` or ``via="eager module"``.

Nothing here runs unless a region exists: a fully traced model never
enters this module.
"""

from __future__ import annotations

import contextlib
import threading
from types import FunctionType, MethodType
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from .gradients import record_grads
from .inplace_ops import INPLACE_NAMES
from .parts import _PartRecords
from .values import flatten_tensors

__all__ = ["EagerScope", "EagerKeys", "RegionForward", "RegionForwards", "REGIONS_ATTR", "OpRecorder",
           "op_key_name", "EAGER_OP", "EAGER_MODULE"]

EAGER_OP = "eager op"
EAGER_MODULE = "eager module"

# Tensor methods fx spells as operators (``x + y`` is ``operator.add`` in a graph).
_REFLECTED = {"radd": "add", "rsub": "sub", "rmul": "mul", "rtruediv": "truediv",
              "rdiv": "truediv", "rmatmul": "matmul", "rpow": "pow", "rfloordiv": "floordiv",
              "rmod": "mod", "rand": "and_", "ror": "or_", "rxor": "xor", "div": "truediv",
              "and": "and_", "or": "or_", "invert": "invert", "neg": "neg"}


def op_key_name(func) -> str:
    """The local name fx gives a call of ``func``: ``matmul``, ``softmax``, ``add``, ``view``.

    >>> op_key_name(torch.matmul), op_key_name(torch.Tensor.view), op_key_name(torch.Tensor.__add__)
    ('matmul', 'view', 'add')
    >>> op_key_name(torch.Tensor.T.__get__)
    'T'
    """
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a tensor property such as ``x.T``
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", "getattr")
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
        if name in INPLACE_NAMES:
            return name  # iadd, imul...: operator.iadd in a graph
        name = _REFLECTED.get(name, name)
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


class EagerKeys:
    """Keys of one run's eager captures: per-call module keys, de-duplicated op keys.

    >>> keys = EagerKeys(["blk", "blk.relu"])
    >>> [keys.allocate("blk.relu", owner=True), keys.allocate("blk.relu"),
    ...  keys.allocate("blk.relu", owner=True), keys.allocate("blk.add"), keys.allocate("blk.add")]
    ['blk.relu', 'blk.relu_op', 'blk.relu_1', 'blk.add', 'blk.add_1']
    """

    def __init__(self, module_paths=()) -> None:
        self._modules: dict[str, None] = dict.fromkeys(module_paths)
        self._calls: dict[str, int] = {}
        self._used: dict[str, None] = {}
        self._next: dict[str, int] = {}

    def allocate(self, base: str, owner: bool = False) -> str:
        """The key of the next call of module ``base`` (``owner``), or of the next op ``base``."""
        if owner:
            count = self._calls.get(base, 0)
            self._calls[base] = count + 1
            key = base if count == 0 else f"{base}_{count}"
        else:
            while base in self._modules:  # F.dropout next to module dropout: not a call's key
                base = f"{base}_op"
            index = self._next.get(base, 0)
            key = base if index == 0 else f"{base}_{index}"
            while key in self._used or self._is_module_key(key):
                index += 1
                key = f"{base}_{index}"
            self._next[base] = index + 1
        self._used[key] = None
        return key

    def _is_module_key(self, key: str) -> bool:
        """A module's path, or the key of a later call of a module."""
        head, _, tail = key.rpartition("_")
        return key in self._modules or (tail.isdigit() and head in self._modules)


class OpRecorder(TorchFunctionMode):
    """Runs every torch function and tensor method, then hands a tensor output to its scope.

    While its ``__torch_function__`` runs the mode is off (torch pops it), so
    the capture's own ``detach``/``clone`` and the ops inside a Python torch
    function (``F.multi_head_attention_forward``) are not recorded again.
    """

    def __init__(self, scope: "EagerScope") -> None:
        super().__init__()
        self.scope = scope

    def __torch_function__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        path = self.scope.current()
        if path is not None and flatten_tensors(output):
            self.scope.record_op(path, func, output)
        return output


class EagerScope:
    """What the eager regions of one instrumented model share: their op recorder and keys.

    Args:
        recorder: the model's Recorder (its ``latest`` Records receive the captures).
        selection: decides per key, with ``for_eager(key)`` for module outputs and
            ``for_op(key)`` for ops, ``(capture mode or None, grads mode or None)``.
        new_keys: makes the key allocator of a run, e.g. ``functools.partial(EagerKeys,
            module_paths)``.
        record_ops: whether any op can be selected at all (``capture="all"`` or patterns);
            without it no TorchFunctionMode is ever pushed.
        seen: called with every key met (selection checks), or None.

    >>> class Everything:
    ...     def for_eager(self, key): return "tensor", None
    ...     def for_op(self, key): return "tensor", None
    >>> from fxdebug.runtime import Recorder
    >>> recorder = Recorder()
    >>> scope = EagerScope(recorder, Everything(), EagerKeys, record_ops=True)
    >>> with scope.region("blk"):
    ...     y = torch.relu(torch.ones(2) - 2)
    >>> recorder.latest.keys(), recorder.latest.record("blk.relu").via
    (['blk.ones', 'blk.sub', 'blk.relu'], 'eager op')
    """

    def __init__(self, recorder, selection, new_keys: Callable[[], Any], record_ops: bool,
                 seen: Callable[[str], None] | None = None) -> None:
        self.recorder, self.selection, self.new_keys = recorder, selection, new_keys
        self.record_ops, self.seen = record_ops, seen
        self._local = _ScopeState()  # per thread: two threads' runs never share a scope

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._local = _ScopeState()

    @property
    def _scopes(self) -> list[str | None]:
        return self._local.scopes

    def running_here(self) -> bool:
        """Whether the instrumented module that owns this scope runs in this thread."""
        return self._local.running > 0

    # -- scopes ------------------------------------------------------------------------
    def current(self) -> str | None:
        """The module path ops are recorded under now; None: not recording."""
        return self._scopes[-1] if self._scopes else None

    @contextlib.contextmanager
    def region(self, path: str):
        """Record the ops run inside, under ``path`` (the outermost region pushes the mode)."""
        outermost = not self._scopes
        self._scopes.append(path)
        mode = None
        if outermost and self.record_ops:
            mode = OpRecorder(self)
            mode.__enter__()
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
            self._scopes.pop()

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside: a traced part, or fxdebug's own work."""
        self._scopes.append(None)
        try:
            yield
        finally:
            self._scopes.pop()

    def active(self) -> bool:
        """Whether an eager region is running (a module call now belongs to it)."""
        return bool(self._scopes)

    # -- keys --------------------------------------------------------------------------
    def allocate(self, base: str, owner: bool) -> str:
        latest = self.recorder.latest
        if isinstance(latest, _PartRecords):  # a traced part's view of the shared Records
            latest = latest.records
        local = self._local
        if local.keys_of is not latest or local.keys is None:
            local.keys, local.keys_of = self.new_keys(), latest
        key = local.keys.allocate(base, owner=owner)
        if self.seen is not None:
            self.seen(key)
        return key

    # -- captures ----------------------------------------------------------------------
    def module_call(self, module: torch.nn.Module, path: str, forward, args, kwargs,
                    ops: bool = True):
        """Run ``forward(*args, **kwargs)`` of the module at ``path`` in its own scope; capture
        its output under the key of this call. ``ops=False``: record no op inside (a
        ``torch.nn`` leaf such as ``Linear``, one node in a graph too)."""
        with self.region(path) if ops else self.paused():
            output = forward(*args, **kwargs)
        key = self.allocate(path, owner=True)
        capture, grads = self.selection.for_eager(key)
        with self.paused():
            self._keep(key, type(module).__name__, output, capture, grads, EAGER_MODULE)
        return output

    def record_op(self, path: str, func, output) -> None:
        name = op_key_name(func)
        key = self.allocate(f"{path}.{name}" if path else name, owner=False)
        capture, grads = self.selection.for_op(key)
        self._keep(key, _op_label(func), output, capture, grads, EAGER_OP)

    def _keep(self, key, op, output, capture, grads, via) -> None:
        if capture is not None:
            # eager code may write to the value in place later: keep a copy
            self.recorder.latest.add(key, op, output, clone=capture == "tensor",
                                     stats_only=capture == "stats", via=via)
        if grads is not None:
            record_grads(self.recorder, output, key, op, stats_only=grads == "stats")


class _ScopeState(threading.local):
    """One thread's side of an EagerScope: its region stack, key allocator, running count."""

    def __init__(self) -> None:
        self.scopes: list[str | None] = []
        self.keys: Any = None  # the run's key allocator (an EagerKeys), made on first use
        self.keys_of: object = None  # the Records it allocates for
        self.running = 0


def _op_label(func) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":
        return f"Tensor.{op_key_name(func)}"
    qualname = getattr(func, "__qualname__", name)
    if qualname.startswith(("Tensor.", "TensorBase.", "_TensorBase.")):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    if module.startswith("torch._C") or module == "torch":
        return f"torch.{name}"
    return f"{module}.{name}"


class RegionForward:
    """The instance ``forward`` of a module that runs eagerly inside an instrumented graph.

    ``entry``: the module a graph node calls (its own output is the node's
    capture); it opens a region under its path. ``ops``: whether ops inside
    are recorded (not inside a ``torch.nn`` leaf without children). Modules below it capture
    their outputs per call (``EagerScope.module_call``) while a region runs.
    """

    __slots__ = ("scope", "module", "path", "entry", "ops")

    def __init__(self, scope: EagerScope, module: torch.nn.Module, path: str, entry: bool,
                 ops: bool = True) -> None:
        self.scope, self.module, self.path, self.entry, self.ops = scope, module, path, entry, ops

    def __call__(self, *args, **kwargs):
        module = self.module
        forward = type(module).forward
        # bound as MethodType: dynamo cannot trace function.__get__ on torch 2.9 (a warning and
        # a graph break); other descriptors (a classmethod forward) bind themselves
        forward = (MethodType(forward, module) if type(forward) is FunctionType
                   else forward.__get__(module))
        if not self.scope.running_here():  # another thread calls the user's module: plain
            return forward(*args, **kwargs)
        if self.entry:
            with self.scope.region(self.path):
                return forward(*args, **kwargs)
        if not self.scope.active():
            return forward(*args, **kwargs)
        return self.scope.module_call(module, self.path, forward, args, kwargs, self.ops)

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state):
        for name, value in state.items():
            setattr(self, name, value)


# The key of an instrumented GraphModule's ``meta`` holding its RegionForwards.
REGIONS_ATTR = "fxdebug_eager_regions"

# id(module) -> [how many runs have it installed, the module]: two threads running one
# GraphModule share the installed forwards; the last to finish removes them.
_INSTALLED: dict[int, list] = {}
_INSTALLED_LOCK = threading.Lock()


class RegionForwards:
    """The modules a GraphModule calls as one node, and how to capture inside them while it runs.

    ``entries`` are ``(path, entry, ops)`` of every module in those subtrees that
    gets a :class:`RegionForward`. The user's modules are never copied: the
    forwards are put into the modules' ``__dict__`` only while the GraphModule
    runs (:meth:`installed`) and removed after, so what a ``forward`` writes to
    its module (``self.cache = ...``) lands on the user's module, and the
    user's own calls of the model record nothing::

        gm(x)                                   DebugGraphModule.__call__
          └─ with regions.installed(gm):        forward -> RegionForward, per module
               block(x) -> RegionForward        captures inside, as before
          (removed here, even when gm raises)
    """

    def __init__(self, scope: EagerScope, entries) -> None:
        self.scope = scope
        self.entries = tuple(entries)

    @contextlib.contextmanager
    def installed(self, root: torch.nn.Module):
        """Install the region forwards on ``root``'s modules for the duration of the block."""
        modules = []
        with _INSTALLED_LOCK:
            for path, entry, ops in self.entries:
                module = root.get_submodule(path)
                state = _INSTALLED.get(id(module))
                if state is not None:
                    state[0] += 1
                elif "forward" in module.__dict__:  # someone else's instance forward: leave it
                    continue
                else:
                    module.__dict__["forward"] = RegionForward(self.scope, module, path, entry, ops)
                    _INSTALLED[id(module)] = [1, module]
                modules.append(module)
        self.scope._local.running += 1
        try:
            yield
        finally:
            self.scope._local.running -= 1
            with _INSTALLED_LOCK:
                for module in modules:
                    state = _INSTALLED[id(module)]
                    state[0] -= 1
                    if state[0] == 0:
                        del _INSTALLED[id(module)]
                        if isinstance(module.__dict__.get("forward"), RegionForward):
                            del module.__dict__["forward"]
