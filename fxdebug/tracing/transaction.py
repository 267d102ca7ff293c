"""The user's model as it was: snapshots of everything fxdebug could change, put back on demand.

Tracing runs the user's ``forward`` and every forward hook with Proxies, and
what that code writes lands on the user's objects: an attribute set in a
hook, a hook registered, FSDP's lazy initialisation (``_is_root``, param
groups), a parameter swapped. A failed call must leave none of it, and a
trace must leave none of it even when it succeeds (the graph holds what it
needs)::

    with model_transaction(model, "fxdebug.instrument"):   instrument(), trace()
        ...                          an exception: the model is put back, then it propagates
    snapshot = ModelSnapshot(model)                        each trace attempt (fx_tracer.py)
    ...; snapshot.restore()                                put back, failed or not

What a snapshot holds, and :meth:`ModelSnapshot.restore` puts back:

* every module of the tree: its class and its ``__dict__`` (attributes, the
  parameter / buffer / submodule registries, every hook dictionary), entries
  compared by identity;
* every object its state reaches within :data:`MAX_HOPS` steps (hook
  callables and the objects they are bound to or close over, e.g. FSDP's and
  DDP's state, and what those hold): their class, ``__dict__`` and the
  contents of every list, dict and set among them;
* every tensor reached: ``requires_grad``, ``.grad``, what ``.data`` is, and
  its ``__dict__``; an in-place write to a parameter or buffer cannot be
  undone without a copy of every weight, so it is named in the error instead;
* torch's process-wide module hooks (``register_module_forward_hook``...).

>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> try:
...     with model_transaction(net, "an example"):
...         _ = net[0].weight.requires_grad_(False)
...         _ = net[0].register_forward_hook(lambda *a: None)
...         net.extra = torch.nn.ReLU()
...         raise ValueError("a step failed")
... except ValueError:
...     pass
>>> net[0].weight.requires_grad, len(net[0]._forward_hooks), hasattr(net, "extra")
(True, 0, False)
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import types
import weakref
from typing import Any, Iterator

import torch

from ..runtime.torch_compat import global_module_hook_names, global_module_hooks_owner
from ..runtime.torch_compat import tensor_version

__all__ = ["ModelSnapshot", "model_transaction", "MAX_HOPS", "MAX_OBJECTS"]

MAX_HOPS = 8
"""How far from a module the snapshot follows plain objects (FSDP: module -> hook -> state ->
param group -> parameter is 4)."""

MAX_OBJECTS = 200_000
"""At most this many objects are snapshotted; a model whose state reaches more (a data set
kept on a module) has the nearest ones put back, and :attr:`ModelSnapshot.complete` says so."""

_ABSENT = object()
_SKIPPED = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType,
            types.BuiltinFunctionType, types.CodeType, types.FrameType, torch.dtype,
            torch.device, torch.layout, torch.memory_format, torch.Size, range, slice,
            memoryview, weakref.ref, weakref.WeakKeyDictionary, weakref.WeakValueDictionary,
            weakref.WeakSet)
# What a value is, for the snapshot; from _HOP on, a step away from a module (an object with
# state of its own, not a container or a hook)
_SKIP, _MODULE, _CONTAINER, _SEQUENCE, _METHOD, _PARTIAL, _FUNCTION, _HOP = range(8)
_TENSOR, _OBJECT = _HOP, _HOP + 1


def _kind(cls: type) -> int:
    """What a value of class ``cls`` is (see the constants above)."""
    for kind, classes in ((_SKIP, _SKIPPED), (_MODULE, torch.nn.Module), (_TENSOR, torch.Tensor),
                          (_CONTAINER, (dict, list, set, collections.deque)),
                          (_SEQUENCE, (tuple, frozenset)), (_METHOD, types.MethodType),
                          (_PARTIAL, functools.partial), (_FUNCTION, types.FunctionType)):
        if issubclass(cls, classes):
            return kind
    return _OBJECT


class _TensorState:
    __slots__ = ("tensor", "requires_grad", "grad", "alias", "place", "version", "registered")

    def __init__(self, tensor: torch.Tensor, registered: bool) -> None:
        self.tensor = tensor
        self.requires_grad = tensor.requires_grad
        self.grad = tensor.grad if tensor.is_leaf else None
        self.alias = tensor.detach()  # the same memory: what to point ``.data`` back to
        self.place = _place(tensor)
        self.version = tensor_version(tensor)
        self.registered = registered

    def restore(self, lost: list[str], name: str) -> None:
        tensor = self.tensor
        if _place(tensor) != self.place:
            with torch.no_grad():
                tensor.data = self.alias
        if tensor.is_leaf and tensor.grad is not self.grad:
            tensor.grad = self.grad
        if tensor.requires_grad != self.requires_grad:
            if tensor.is_leaf:
                tensor.requires_grad_(self.requires_grad)
            else:
                lost.append(f"{name}.requires_grad (not a leaf tensor)")
        if self.registered and tensor_version(tensor) != self.version:
            lost.append(f"{name} (written in place)")


def _place(tensor: torch.Tensor) -> tuple:
    """What a tensor is a view of: changes when ``.data`` is replaced, not when values change."""
    try:
        pointer = tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass (DTensor)
        pointer = None
    return (type(tensor), tensor.dtype, tensor.device, tuple(tensor.shape),
            tuple(tensor.stride()) if tensor.layout == torch.strided else None,
            tensor.storage_offset() if tensor.layout == torch.strided else None, pointer)


class ModelSnapshot:
    """Everything fxdebug could change in ``model`` (see the module doc), ready to put back.

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> snapshot = ModelSnapshot(net)
    >>> net.train(False); net[0].bias = None
    Sequential(...)
    >>> snapshot.changes()
    ['0 (Linear)._parameters: contents differ', '0 (Linear): training differs', 'root (Sequential): training differs']
    >>> snapshot.restore(), net.training, net[0].bias is not None, snapshot.changes()
    ([], True, True, [])
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.complete = True
        self._names: dict[int, str | tuple] = {}  # see _resolve
        self._classes: dict[int, tuple[object, type]] = {}
        self._dicts: dict[int, tuple[dict, dict]] = {}
        self._containers: dict[int, tuple[Any, list]] = {}
        self._cells: dict[int, tuple[types.CellType, object]] = {}
        self._tensors: dict[int, _TensorState] = {}
        owner = global_module_hooks_owner()
        self._globals = {name: getattr(owner, name, _ABSENT) for name in global_module_hook_names()}
        for value in self._globals.values():
            if isinstance(value, dict):
                self._containers[id(value)] = (value, list(value.items()))
        self._take(model)

    # -- taking -----------------------------------------------------------------------------
    def _take(self, model: torch.nn.Module) -> None:
        registered = {id(tensor) for module in model.modules()
                      for tensor in [*module.parameters(recurse=False), *module.buffers(False)]}
        paths = {id(module): path for path, module in model.named_modules()}
        kinds: dict[type, int] = {}  # what each type of value is, worked out once per snapshot
        names = self._names
        queue: collections.deque = collections.deque([(model, "", 0)])
        while queue:
            value, name, hops = queue.popleft()
            key = id(value)
            if key in names:
                continue
            kind = kinds.get(type(value))
            if kind is None:
                kind = kinds[type(value)] = _kind(type(value))
            if kind == _SKIP:
                continue
            if len(names) >= MAX_OBJECTS:
                self.complete = False
                return
            if kind == _MODULE:
                hops = 0
                name = f"{paths.get(key) or self._resolve(name) or 'root'} ({type(value).__name__})"
            elif kind >= _HOP:
                hops += 1
                if hops > MAX_HOPS:
                    self.complete = False
                    continue
            names[key] = name
            item = kind == _CONTAINER or kind == _SEQUENCE  # its children are items, not attributes
            for label, child in self._remember(value, kind, key in registered):
                queue.append((child, (key, label, item), hops))

    def _remember(self, value, kind: int, registered: bool) -> Iterator[tuple[object, object]]:
        """Remember ``value``'s own state; yield ``(label, child)`` for what it refers to (an
        attribute's name, or an item's key or index)."""
        if kind == _TENSOR:
            self._tensors[id(value)] = _TensorState(value, registered)
            if value.grad is not None:
                yield "grad", value.grad
        elif kind == _CONTAINER:
            contents = _contents(value)
            self._containers[id(value)] = (value, contents)
            yield from (contents if isinstance(value, dict) else enumerate(contents))
            return
        elif kind == _SEQUENCE:
            yield from enumerate(value)
            return
        elif kind == _METHOD:
            yield "__self__", value.__self__
            return
        elif kind == _PARTIAL:
            yield "func", value.func
            yield "args", value.args
            yield "keywords", value.keywords
            return
        elif kind == _FUNCTION:
            for index, cell in enumerate(value.__closure__ or ()):
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    contents = _ABSENT
                self._cells[id(cell)] = (cell, contents)
                if contents is not _ABSENT:
                    yield f"<closure {index}>", contents
            return
        state = getattr(value, "__dict__", None)
        if not isinstance(state, dict):
            return
        self._classes[id(value)] = (value, type(value))
        saved = dict(state)
        self._dicts[id(value)] = (state, saved)
        for key, item in saved.items():
            yield key, item

    def _resolve(self, name: str | tuple) -> str:
        """A remembered value's name: a module's, or ``(parent's id, label, item)``, put
        together only when read (most snapshots never name anything)."""
        parts = []
        while not isinstance(name, str):
            parent, label, item = name
            parts.append(f"[{label!r}]" if item else f".{label}")
            name = self._names[parent]
        return name + "".join(reversed(parts))

    def _name(self, key: int, default: str = "?") -> str:
        name = self._names.get(key)
        return default if name is None else self._resolve(name)

    # -- comparing and restoring ------------------------------------------------------------
    def changes(self) -> list[str]:
        """What differs from the snapshot now, one line each, sorted."""
        found = []
        for key, (value, cls) in self._classes.items():
            if type(value) is not cls:
                found.append(f"{self._name(key)}: class {cls.__name__} -> {type(value).__name__}")
        for key, (own, saved_dict) in self._dicts.items():
            found.extend(f"{self._name(key)}: {detail}"
                         for detail in _dict_changes(own, saved_dict))
        for key, (container, saved_items) in self._containers.items():
            if not _same_contents(container, saved_items):
                found.append(f"{self._name(key, 'torch module hooks')}: contents differ")
        for key, kept in self._tensors.items():
            tensor = kept.tensor
            if (_place(tensor) != kept.place or tensor.requires_grad != kept.requires_grad
                    or (tensor.is_leaf and tensor.grad is not kept.grad)):
                found.append(f"{self._name(key)}: tensor state differs")
            elif kept.registered and tensor_version(tensor) != kept.version:
                found.append(f"{self._name(key)}: written in place")
        return sorted(found)

    def restore(self) -> list[str]:
        """Put every remembered object back as it was; what could not be undone, one line each."""
        lost: list[str] = []
        owner = global_module_hooks_owner()
        for name, value in self._globals.items():
            if getattr(owner, name, _ABSENT) is not value and value is not _ABSENT:
                setattr(owner, name, value)
        for value, cls in self._classes.values():
            if type(value) is not cls:
                object.__setattr__(value, "__class__", cls)
        for own, saved_dict in self._dicts.values():
            if not _same_dict(own, saved_dict):
                own.clear()
                own.update(saved_dict)
        for container, saved_items in self._containers.values():
            _restore_contents(container, saved_items)
        for cell, contents in self._cells.values():
            if contents is not _ABSENT and _cell_value(cell) is not contents:
                cell.cell_contents = contents
        for key, tensor_state in self._tensors.items():
            tensor_state.restore(lost, self._name(key))
        return sorted(lost)


def _cell_value(cell: types.CellType):
    try:
        return cell.cell_contents
    except ValueError:
        return _ABSENT


def _contents(container):
    if isinstance(container, dict):
        return list(container.items())
    return list(container)


def _same_dict(state: dict, saved: dict) -> bool:
    """Whether ``state`` holds the very objects ``saved`` holds, under the same keys."""
    return len(state) == len(saved) and all(
        state.get(key, _ABSENT) is value for key, value in saved.items())


def _same_contents(container, saved: list) -> bool:
    """Whether ``container`` holds the very objects of ``saved`` (what :func:`_contents` made
    of it), in the same order."""
    if len(container) != len(saved):
        return False
    if isinstance(container, dict):
        return all(key is saved_key and value is saved_value for (key, value), (saved_key, saved_value)
                   in zip(container.items(), saved))
    return all(item is saved_item for item, saved_item in zip(container, saved))


def _restore_contents(container, saved: list) -> None:
    if _same_contents(container, saved):
        return
    if isinstance(container, dict):
        container.clear()
        container.update(saved)
    elif isinstance(container, list):
        container[:] = saved
    else:  # set, deque
        container.clear()
        container.update(saved) if isinstance(container, set) else container.extend(saved)


def _dict_changes(state: dict, saved: dict) -> list[str]:
    found = [f"{key} added" for key in state if key not in saved]
    found += [f"{key} removed" for key in saved if key not in state]
    found += [f"{key} differs" for key, value in saved.items()
              if key in state and state[key] is not value]
    return found


@contextlib.contextmanager
def model_transaction(model: torch.nn.Module, caller: str) -> Iterator[ModelSnapshot | None]:
    """Run the block; if it raises, put ``model`` back as it was before it, then re-raise.

    The exception gets a note saying the model was restored (and what could
    not be, if anything). See the module doc for what is put back.
    """
    open_here = _open.__dict__.setdefault("models", [])
    if not isinstance(model, torch.nn.Module) or any(m is model for m in open_here):
        yield None  # not a module (the call refuses it), or inside instrument()'s own transaction
        return
    snapshot = ModelSnapshot(model)
    open_here.append(model)
    try:
        yield snapshot
    except BaseException as exc:
        lost = snapshot.restore()
        if lost:
            exc.add_note(f"fxdebug: {caller} failed and put {type(model).__name__} back as it was, "
                         f"except what cannot be undone: {'; '.join(lost[:5])}"
                         f"{' ...' if len(lost) > 5 else ''}.")
        raise
    finally:
        open_here.pop()


_open = threading.local()  # .models: the models of this thread's open transactions
