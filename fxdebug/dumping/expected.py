"""expected.pt's contents: what the module gives on the example inputs, the user's module untouched.

The outputs (and parameter gradients) come from a run of a *copy* of the
module, seed 0, the caller's RNG untouched: a forward may write its buffers
(batch norm's running statistics), attributes, its recorder's Records, and a
backward fills ``.grad``. Copying every weight costs as much as the dump
itself, so the copy is light where that is safe::

    expected_results(gm, inputs)
      ├─ light_copy(gm)        new module objects (their attributes deep-copied, buffers
      │                        cloned), sharing the graph and code; each parameter an
      │                        alias of the user's storage (a new Parameter: .grad lands there),
      │                        or a copy of it where all weights take at most COPIED_WEIGHT_BYTES
      ├─ run under _GuardShared forward (and backward) with every ATen op checked: one that
      │                        would write into a parameter's storage stops the run first
      │                        (no guard when the weights were copied: nothing is shared)
      └─ deep copy, run again  when the guard stopped it, or a module that copies itself its
                               own way (``__deepcopy__``, ``__getstate__``...) holds
                               parameters, or a parameter is not a plain dense Parameter

The guard sees ATen ops: a write into a parameter's memory that bypasses them (through
a NumPy view, a C extension without an op schema) is not seen.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch
import torch.fx as fx
from ..runtime import clone_inputs, outputs_loss, stops_disabled
from ..base import torch_compat
from ..base.torch_compat import TorchDispatchMode
from ..tracing.graph_module import MODES_META
from .folder_runtime import first_line, flatten_outputs

__all__ = ["expected_results", "light_copy"]

# How a module may copy itself: a class that changes one of these copies its own way. (Many
# torch.nn classes change __setstate__, to fill attributes old pickles lack: the copy calls it.)
_COPY_PROTOCOL = ("__deepcopy__", "__copy__", "__reduce_ex__", "__reduce__", "__getstate__")
# GraphModule attributes the copy shares: the graph and the code generated from it (read only).
_SHARED_GRAPH_ATTRS = torch_compat.GRAPH_MODULE_SHARED_ATTRS

# Hooks on a GraphModule itself that GraphModule.__deepcopy__ does not keep (nor does module.py).
_DROPPED_GRAPH_MODULE_HOOKS = torch_compat.GRAPH_MODULE_HOOK_ATTRS

COPIED_WEIGHT_BYTES = 16 << 20
"""Weights up to this size are copied for the run: cheaper than checking every op (a
10k-module model of small layers spends more time in the guard than in its ops)."""

_SHARED_TYPES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.layout)
_EMPTY_CONTAINERS = (dict, collections.OrderedDict, set, list)


class _WritesShared(Exception):
    """An op was about to write into a parameter's storage, which the light copy shares."""


class _GuardShared(TorchDispatchMode):
    """Raise :class:`_WritesShared` before any ATen op writes into one of ``storages``."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.stopped = ""  # the op it stopped, if any (the model may have caught the exception)
        self._writes: dict = {}  # op -> its written arguments' (position, name)

    def _written(self, func) -> tuple:
        found = self._writes.get(func)
        if found is None:
            schema = torch_compat.op_schema(func)
            found = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                          if a.alias_info is not None and a.alias_info.is_write) if schema.is_mutable else ()
            self._writes[func] = found
        return found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for index, name in self._written(func):
            value = args[index] if index < len(args) else kwargs.get(name)
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(tensor, torch.Tensor) and _storage_key(tensor) in self.storages:
                    self.stopped = str(func)
                    raise _WritesShared(f"{func} would write into a parameter")
        return func(*args, **kwargs)


def _storage_key(tensor: torch.Tensor) -> int | None:
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    pointer = tensor.untyped_storage().data_ptr()
    return pointer or None


def _copies_itself(cls: type) -> bool:
    """Whether deepcopy copies ``cls``'s modules another way than a Module's (or slots hold state)."""
    base = fx.GraphModule if issubclass(cls, fx.GraphModule) else torch.nn.Module
    return any(getattr(cls, name, None) is not getattr(base, name, None) for name in _COPY_PROTOCOL
               if not (base is fx.GraphModule and name == "__reduce__")  # DebugGraphModule pickles meta
               ) or any(vars(k).get("__slots__") for k in cls.__mro__)


def light_copy(gm: torch.nn.Module, copy_weights_up_to: int = 0
               ) -> tuple[torch.nn.Module, set[int]] | None:
    """A runnable copy of ``gm`` and its parameters' storages (shared), or None where unsafe.

    Where all parameters take at most ``copy_weights_up_to`` bytes, each is
    copied instead, and the set of shared storages is empty.

    Every module is a new object of the same class; its attributes are deep-copied
    (one memo: references between modules, hooks bound to them, ``gm.meta``'s
    recorders point into the copy), its buffers cloned, its parameters new
    ``Parameter`` objects on the same storage, so gradients land in the copy.
    A GraphModule shares the graph and the generated code, and runs it in the modes it is
    in: its copy leaves out the follower that would rebuild the graph of other modes. A module that copies
    itself its own way (``__deepcopy__``, ``__getstate__``: fxdebug's Recorder
    starts with empty Records) is deep-copied, if it holds no parameter itself.
    None when one does, or a parameter is not a plain dense ``Parameter``: the
    caller deep-copies then.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> twin, storages = light_copy(model)
    >>> twin[0] is model[0], twin[0].weight is model[0].weight, twin[0].weight.data_ptr() == model[0].weight.data_ptr()
    (False, False, True)
    >>> twin, storages = light_copy(model, copy_weights_up_to=1 << 20)
    >>> storages, twin[0].weight.data_ptr() == model[0].weight.data_ptr()
    (set(), False)
    """
    modules = list(gm.modules())  # each object once
    for module in modules:  # code generated on first use: generate it now, once, for both
        if isinstance(module, fx.GraphModule):
            module.code  # noqa: B018 - the property generates the code of a DebugGraphModule
    own_way = dict.fromkeys(cls for cls in dict.fromkeys(type(m) for m in modules)
                            if _copies_itself(cls))
    copied = [m for m in modules if type(m) in own_way]  # deep-copied whole, e.g. the Recorder
    modules = [m for m in modules if type(m) not in own_way]
    params = [p for m in modules for p in torch_compat.own_parameters(m).values() if p is not None]
    if any(p is not None for m in copied for p in torch_compat.own_parameters(m).values()) or any(
            type(p) is not torch.nn.Parameter or _storage_key(p) is None for p in params):
        return None
    memo: dict[int, Any] = {}  # deepcopy's memo: the copies by the original's id
    unique = list({id(p): p for p in params}.values())
    copied_weights = (sum(p.numel() * p.element_size() for p in unique) <= copy_weights_up_to
                      and len({_storage_key(p) for p in unique}) == len(unique))  # no two alias
    for p in unique:
        value = p.detach().clone() if copied_weights else p.detach()
        memo[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
    for m in modules:
        memo[id(m)] = object.__new__(type(m))  # the same class: a GraphModule's holds its forward
    for m in copied:
        copy.deepcopy(m, memo)  # its own way; modules it holds are the copies above
    for m in modules:
        state = {}
        for name, value in vars(m).items():
            if name == torch_compat.PARAMETERS_ATTR:
                state[name] = {k: None if p is None else memo[id(p)] for k, p in value.items()}
            elif name == torch_compat.CHILDREN_ATTR:
                state[name] = {k: None if c is None else memo[id(c)] for k, c in value.items()}
            elif name == torch_compat.BUFFERS_ATTR:
                state[name] = {k: copy.deepcopy(b, memo) for k, b in value.items()}
            elif isinstance(m, fx.GraphModule) and name in _SHARED_GRAPH_ATTRS:
                state[name] = value
            elif isinstance(m, fx.GraphModule) and name in _DROPPED_GRAPH_MODULE_HOOKS:
                state[name] = type(value)()  # as GraphModule.__deepcopy__: its __init__ drops them
            elif isinstance(m, fx.GraphModule) and name == "meta" and isinstance(value, dict):
                state[name] = copy.deepcopy(_one_mode(value), memo)
            elif type(value) in _SHARED_TYPES:
                state[name] = value  # what deepcopy would return itself
            elif type(value) in _EMPTY_CONTAINERS and not value:
                state[name] = type(value)()  # most hook dicts
            else:
                state[name] = copy.deepcopy(value, memo)
        memo[id(m)].__setstate__(state)  # as deepcopy does (Module's: update __dict__)
    storages = set() if copied_weights else {
        key for p in params if (key := _storage_key(p)) is not None}
    return memo[id(gm)], storages


def _one_mode(meta: dict) -> dict:
    """A GraphModule's meta without its mode follower: the copy runs the graph of the mode
    the module is in (``dump`` followed it first) and rebuilds no other (nor copies the model)."""
    return {key: value for key, value in meta.items() if key != MODES_META}


def _run(model: torch.nn.Module, inputs: tuple) -> dict:
    with torch.random.fork_rng(devices=[]), stops_disabled():
        torch.manual_seed(0)
        output = model(*clone_inputs(inputs))
        flat = flatten_outputs(output)
        grads: dict[str, torch.Tensor] = {}
        backward_error = ""
        loss = outputs_loss(output) if torch.is_grad_enabled() else None  # check_equivalence's
        if loss is not None:
            try:
                loss.backward()
            except RuntimeError as exc:  # e.g. an in-place op autograd rejects: run.py shows it again
                backward_error = first_line(exc)
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
                     if p.grad is not None and not backward_error}
    outputs = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    return {"outputs": outputs, "grads": grads, "backward_error": backward_error}


def expected_results(gm: torch.nn.Module, inputs: tuple) -> dict:
    """``{"outputs", "grads", "backward_error"}`` of a copy of ``gm`` on ``inputs`` (seed 0).

    >>> import torch
    >>> bn = torch.nn.Sequential(torch.nn.BatchNorm1d(2)).train()
    >>> before = bn[0].running_mean.clone()
    >>> result = expected_results(bn, (torch.randn(4, 2),))
    >>> torch.equal(bn[0].running_mean, before), bn[0].weight.grad is None, sorted(result["grads"])
    (True, True, ['0.bias', '0.weight'])
    """
    light = light_copy(gm, COPIED_WEIGHT_BYTES)
    if light is not None:
        model, storages = light
        if not storages:  # the weights were copied: nothing of the user's can be written
            return _run(model, inputs)
        guard = _GuardShared(storages)
        try:
            with guard:
                result = _run(model, inputs)
        except Exception:
            if not guard.stopped:  # the model's own error, as a deep copy would raise it
                raise
        else:
            if not guard.stopped:
                return result
        # the model writes into a parameter (which the light copy shares): a deep copy then
    copied = copy.deepcopy(gm)
    meta = getattr(copied, "meta", None)
    if isinstance(meta, dict):
        meta.pop(MODES_META, None)  # the copy's own meta: it runs in the modes gm is in
    return _run(copied, inputs)
