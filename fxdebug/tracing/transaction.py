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

Its cost is some objects per module, not per object reached: a container
empty when taken (most of a module's hook dictionaries) is only listed, to be
emptied again; names (for messages) and the module tree's paths are worked
out from what was saved, only when a message needs them. A snapshot keeps
few objects the garbage collector tracks, so taking one on a model of 10k
modules does not set off full collections (:attr:`ModelSnapshot.kept`).

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
import operator
import threading
import types
import weakref
from typing import Any, Iterator

import torch

from ..base.torch_compat import global_module_hook_names, global_module_hooks_owner
from ..base.torch_compat import BUFFERS_ATTR, CHILDREN_ATTR, PARAMETERS_ATTR, tensor_version

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
    __slots__ = ("tensor", "cls", "requires_grad", "grad", "alias", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.cls = type(tensor)
        self.requires_grad = tensor.requires_grad
        self.grad = tensor.grad if tensor.is_leaf else None
        self.alias = tensor.detach()  # the same memory: what to point ``.data`` back to
        self.version = tensor_version(tensor)

    def differs(self) -> bool:
        """Whether ``.data``, ``requires_grad`` or ``.grad`` is not what it was."""
        tensor = self.tensor
        return (not _same_place(tensor, self.alias) or tensor.requires_grad != self.requires_grad
                or (tensor.is_leaf and tensor.grad is not self.grad))

    def written(self) -> bool:
        return tensor_version(self.tensor) != self.version

    def restore(self, registered: bool) -> list[str]:
        """Put the tensor's state back; what could not be, as suffixes of its name."""
        lost, tensor = [], self.tensor
        if type(tensor) is not self.cls:
            object.__setattr__(tensor, "__class__", self.cls)
        if not _same_place(tensor, self.alias):
            with torch.no_grad():
                tensor.data = self.alias
        if tensor.is_leaf and tensor.grad is not self.grad:
            tensor.grad = self.grad
        if tensor.requires_grad != self.requires_grad:
            if tensor.is_leaf:
                tensor.requires_grad_(self.requires_grad)
            else:
                lost.append(".requires_grad (not a leaf tensor)")
        if registered and self.written():
            lost.append(" (written in place)")
        return lost


def _same_place(tensor: torch.Tensor, alias: torch.Tensor) -> bool:
    """Whether ``tensor`` is still a view of what ``alias`` (its detached alias when taken) is:
    false once ``.data`` is replaced, true when only values change."""
    if (tensor.dtype != alias.dtype or tensor.device != alias.device
            or tensor.layout != alias.layout or tensor.shape != alias.shape):
        return False
    if tensor.layout == torch.strided and (tensor.stride() != alias.stride()
                                           or tensor.storage_offset() != alias.storage_offset()):
        return False
    return _pointer(tensor) == _pointer(alias)


def _pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass (DTensor)
        return None


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
        self._root = model
        # what reached each value: its parent's id (None: the root) and its label (an
        # attribute's name, or an item's key or index): names, see _resolve
        self._parents: dict[int, int | None] = {}
        self._labels: dict[int, object] = {}
        self._sequences: set[int] = set()  # tuples walked: their children are items
        # an object with a __dict__: (it, its class, its __dict__, a copy of that)
        self._objects: dict[int, tuple[object, type, dict, dict]] = {}
        self._full: dict[int, tuple[Any, Any]] = {}  # a container not empty: (it, a copy)
        self._empty: list = []  # containers empty when taken
        self._cells: list[tuple[types.CellType, object]] = []
        self._tensors: dict[int, _TensorState] = {}
        self._paths: dict[int, str] | None = None  # worked out when a name is asked for
        owner = global_module_hooks_owner()
        self._globals = {name: getattr(owner, name, _ABSENT) for name in global_module_hook_names()}
        self._global_contents = [(value, dict(value)) for value in self._globals.values()
                                 if isinstance(value, dict)]
        self._take(model)

    @property
    def kept(self) -> int:
        """How many values the snapshot holds a saved state for (containers empty when taken
        not counted): a test's measure of its work, which grows with modules and tensors."""
        return len(self._objects) + len(self._full) + len(self._tensors) + len(self._cells)

    # -- taking -----------------------------------------------------------------------------
    def _take(self, model: torch.nn.Module) -> None:
        """Breadth first from ``model``; a value is named by the path that reaches it first.

        Allocation-light on purpose: no tuple per value walked (a link is two dict entries,
        the queue two deques), so that the garbage collector is not set off."""
        kinds: dict[type, int] = {}  # what each type of value is, worked out once per snapshot
        parents, labels, objects, full, empty = (self._parents, self._labels, self._objects,
                                                 self._full, self._empty)
        values: collections.deque = collections.deque([model])
        distances: collections.deque = collections.deque([0])  # hops from a module, per value
        parents[id(model)] = None
        while values:
            value, hops = values.popleft(), distances.popleft()
            key = id(value)
            kind = kinds.get(type(value))
            if kind is None:
                kind = kinds[type(value)] = _kind(type(value))
            children: Any = ()
            if kind == _CONTAINER:
                saved = dict(value) if isinstance(value, dict) else list(value)
                full[key] = (value, saved)
                children = saved.items() if isinstance(saved, dict) else enumerate(saved)
            elif kind == _SEQUENCE:
                self._sequences.add(key)
                children = enumerate(value)
            elif kind == _METHOD:
                children = (("__self__", value.__self__),)
            elif kind == _PARTIAL:
                children = (("func", value.func), ("args", value.args),
                            ("keywords", value.keywords))
            elif kind == _FUNCTION:
                children = self._closure(value)
            else:  # a module, a tensor or an object: its __dict__
                if kind == _TENSOR:
                    self._tensors[key] = _TensorState(value)
                    if value.grad is not None:
                        children = (("grad", value.grad),)
                state = getattr(value, "__dict__", None)
                if isinstance(state, dict) and (state or kind != _TENSOR):
                    saved = dict(state)
                    objects[key] = (value, type(value), state, saved)
                    children = [*children, *saved.items()] if children else saved.items()
                elif isinstance(state, dict):
                    empty.append(state)
            for label, child in children:
                child_kind = kinds.get(type(child))
                if child_kind is None:
                    child_kind = kinds[type(child)] = _kind(type(child))
                if child_kind == _SKIP:
                    continue
                if child_kind == _CONTAINER or child_kind == _SEQUENCE:
                    if not child:  # nothing to walk: an empty one is only emptied again
                        if child_kind == _CONTAINER:
                            empty.append(child)
                        continue
                child_key = id(child)
                if child_key in parents:  # reached already: first come (nearest) first named
                    continue
                distance = 0 if child_kind == _MODULE else hops + (child_kind >= _HOP)
                if distance > MAX_HOPS:
                    self.complete = False
                    continue
                if len(parents) >= MAX_OBJECTS:
                    self.complete = False
                    return
                parents[child_key] = key
                labels[child_key] = label
                values.append(child)
                distances.append(distance)

    def _closure(self, function: types.FunctionType) -> list[tuple[str, object]]:
        children = []
        for index, cell in enumerate(function.__closure__ or ()):
            contents = _cell_value(cell)
            self._cells.append((cell, contents))
            if contents is not _ABSENT:
                children.append((f"<closure {index}>", contents))
        return children

    # -- naming (only when a message needs it) ----------------------------------------------
    def _module_paths(self) -> dict[int, str]:
        """``id(module) -> path`` of the tree as it was taken, as ``named_modules`` names it."""
        if self._paths is None:
            paths: dict[int, str] = {}
            stack = [(self._root, "")]
            while stack:
                module, path = stack.pop()
                if id(module) in paths:
                    continue
                paths[id(module)] = path
                children = [(child, f"{path}.{name}" if path else str(name))
                            for name, child in self._items_as_taken(module, CHILDREN_ATTR)
                            if isinstance(child, torch.nn.Module)]
                stack.extend(reversed(children))
            self._paths = paths
        return self._paths

    def _items_as_taken(self, owner: object, attribute: str) -> list:
        """The items of ``owner.<attribute>`` (a dict) as taken."""
        record = self._objects.get(id(owner))
        registry = None if record is None else record[3].get(attribute)
        kept = self._full.get(id(registry))
        return list(kept[1].items()) if kept is not None and isinstance(kept[1], dict) else []

    def _registered(self) -> set[int]:
        """The ids of the tree's parameters and buffers as taken."""
        found: set[int] = set()
        for key in self._module_paths():
            module = self._objects[key][0]
            for attribute in (PARAMETERS_ATTR, BUFFERS_ATTR):
                found.update(id(tensor) for _, tensor in self._items_as_taken(module, attribute)
                             if isinstance(tensor, torch.Tensor))
        return found

    def _resolve(self, key: int) -> str:
        """A remembered value's name: a module's path, or its parent's name and its label."""
        record = self._objects.get(key)
        if record is not None and isinstance(record[0], torch.nn.Module):
            path = self._module_paths().get(key) or self._chain(key) or "root"
            return f"{path} ({record[1].__name__})"
        return self._chain(key) or "root"

    def _chain(self, key: int) -> str:
        """``key``'s parent's name and its label; "" for the root."""
        parent = self._parents.get(key)
        if parent is None:
            return ""
        label = self._labels[key]
        item = parent in self._full or parent in self._sequences
        return self._resolve(parent) + (f"[{label!r}]" if item else f".{label}")

    def _empty_name(self, container: object) -> str:
        """The name of a container that was empty when taken: found where it was held."""
        for key, (value, _, state, saved) in self._objects.items():
            for label, held in saved.items():
                if held is container:
                    return f"{self._resolve(key)}.{label}"
        for key, (value, saved) in self._full.items():
            for label, held in (saved.items() if isinstance(saved, dict) else enumerate(saved)):
                if held is container:
                    return f"{self._resolve(key)}[{label!r}]"
        for key, kept in self._tensors.items():
            if getattr(kept.tensor, "__dict__", None) is container:
                return f"{self._resolve(key)}.__dict__"
        return "?"

    # -- comparing and restoring ------------------------------------------------------------
    def changes(self) -> list[str]:
        """What differs from the snapshot now, one line each, sorted."""
        found = []
        for key, (value, cls, state, saved) in self._objects.items():
            if type(value) is not cls:
                found.append(f"{self._resolve(key)}: class {cls.__name__} -> "
                             f"{type(value).__name__}")
            found.extend(f"{self._resolve(key)}: {detail}"
                         for detail in _dict_changes(state, saved))
        for key, (container, saved) in self._full.items():
            if not _same_contents(container, saved):
                found.append(f"{self._resolve(key)}: contents differ")
        found.extend(f"{self._empty_name(container)}: contents differ"
                     for container in self._empty if container)
        found.extend("torch module hooks: contents differ"
                     for value, saved in self._global_contents if not _same_contents(value, saved))
        registered = None
        for key, kept in self._tensors.items():
            if kept.differs() or type(kept.tensor) is not kept.cls:
                found.append(f"{self._resolve(key)}: tensor state differs")
            elif kept.written():
                registered = self._registered() if registered is None else registered
                if key in registered:
                    found.append(f"{self._resolve(key)}: written in place")
        return sorted(found)

    def restore(self) -> list[str]:
        """Put every remembered object back as it was; what could not be undone, one line each."""
        lost: list[str] = []
        owner = global_module_hooks_owner()
        for name, value in self._globals.items():
            if getattr(owner, name, _ABSENT) is not value and value is not _ABSENT:
                setattr(owner, name, value)
        for value, saved in self._global_contents:
            _restore_contents(value, saved)
        for value, cls, state, saved in self._objects.values():
            if type(value) is not cls:
                object.__setattr__(value, "__class__", cls)
            if not _same_dict(state, saved):
                state.clear()
                state.update(saved)
        for container, saved in self._full.values():
            _restore_contents(container, saved)
        for container in self._empty:
            if container:
                container.clear()
        for cell, contents in self._cells:
            if contents is not _ABSENT and _cell_value(cell) is not contents:
                cell.cell_contents = contents
        written = [key for key, kept in self._tensors.items() if kept.written()]
        registered = self._registered() if written else set()
        for key, kept in self._tensors.items():
            lost.extend(self._resolve(key) + suffix for suffix in kept.restore(key in registered))
        return sorted(lost)


def _cell_value(cell: types.CellType):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _ABSENT


def _same_dict(state: dict, saved: dict) -> bool:
    """Whether ``state`` holds the very objects ``saved`` holds, under the same keys (in the
    same order: a reordered dict counts as changed, and is put back in order)."""
    return (len(state) == len(saved) and state.keys() == saved.keys()
            and all(map(operator.is_, state.values(), saved.values())))


def _same_contents(container, saved) -> bool:
    """Whether ``container`` holds the very objects of ``saved`` (its copy), in the same order."""
    if len(container) != len(saved):
        return False
    if isinstance(container, dict):
        return (all(map(operator.is_, container, saved))
                and all(map(operator.is_, container.values(), saved.values())))
    return all(map(operator.is_, container, saved))


def _restore_contents(container, saved) -> None:
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
