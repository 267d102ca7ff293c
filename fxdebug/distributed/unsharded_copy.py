"""unsharded_copy: a sharded model (FSDP2, tensor parallel) as a plain module on every rank.

A model sharded with ``fully_shard`` or ``parallelize_module`` holds ``DTensor``
parameters (each rank a piece) and runs collectives in forward hooks. The copy is
the model unsharded: the same modules, names and classes, every parameter and
buffer a full plain tensor, and none of torch.distributed's machinery::

    unsharded_copy(model)                                           a collective
      ├─ checks, on every rank: no tensor on the meta device, every DTensor's mesh
      │    holds this rank, the meshes span the group; an error on one rank is raised
      │    on all  (agreement.py)
      ├─ full values: ``DTensor.full_tensor()`` of each parameter, then each buffer, in
      │    ``named_parameters()`` / ``named_buffers()`` order (the same on every rank)
      └─ each module copied (shared modules and tied parameters stay shared): the class
           before fully_shard's swap, its attributes, torch.distributed's forward hooks
           and flags left out, the user's hooks kept  (torch_compat.module_shell)

    eval_outputs(copy, x), eval_outputs(model, x)                   the latter a collective
      └─ both forwards on this rank's batch (eval mode, no grad, the same seed), for the
           caller to compare: a tensor-parallel plan that also changes a module's
           attributes (a per-rank head count) makes a copy that computes another function,
           and this is how the caller finds out, instead of measuring it.

The model is not changed: not its parameters, their ``.grad``, nor FSDP2's sharded or
unsharded state. The copy's parameters are its own (cloned), on the device the shards
were on.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base import torch_compat
from ..errors import FxdebugError
from ..runtime.values import flatten_tensors
from .agreement import attempt, raise_if_any_failed
from .rank_group import RankGroup, ranks_text
from .sharded_replay import kept_parameters

__all__ = ["unsharded_copy", "is_dtensor", "sharded_reason", "eval_outputs"]


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``.

    >>> is_dtensor(torch.ones(1))
    False
    """
    if not (torch.distributed.is_available() and isinstance(tensor, torch.Tensor)):
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)


def sharded_reason(model: torch.nn.Module) -> str:
    """Why ``model`` is sharded (``fully_shard`` applied to a module, a DTensor parameter),
    or ``""``.

    >>> sharded_reason(torch.nn.Linear(1, 1))
    ''
    """
    if not torch.distributed.is_available():
        return ""
    from torch.distributed.fsdp import FSDPModule
    path = next((p for p, m in model.named_modules() if isinstance(m, FSDPModule)), None)
    if path is not None:
        return f"fully_shard was applied to {path or '(root)'!r}"
    name = next((n for n, p in model.named_parameters() if is_dtensor(p)), None)
    return f"parameter {name!r} is a DTensor (tensor parallelism)" if name else ""


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, str, Any]]:
    return [("parameter", name, p) for name, p in model.named_parameters()] + \
        [("buffer", name, b) for name, b in model.named_buffers()]


def _check(model: torch.nn.Module, ranks: RankGroup) -> None:
    """Raise for a tensor whose full value cannot be assembled on this rank, and for meshes
    that do not span the group (the copy is the same whole model on every rank)."""
    spanned: dict[int, None] = {}
    for kind, name, tensor in _named_tensors(model):
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        if tensor.is_meta or local.is_meta:
            raise FxdebugError(
                f"{kind} {name!r} of {type(model).__name__} is on the meta device (never "
                f"materialised), so it has no values to gather; materialise the model first "
                f"(model.to_empty(device=...), then initialise or load its weights) and call "
                f"this again.")
        if not is_dtensor(tensor):
            continue
        if tensor.device_mesh.get_coordinate() is None:
            raise FxdebugError(
                f"{kind} {name!r} of {type(model).__name__} is a DTensor on a device mesh that "
                f"rank {ranks.rank} is not part of (mesh {tensor.device_mesh}), so this rank "
                f"cannot assemble it; call this on the ranks of the model's mesh only.")
        spanned.update(dict.fromkeys(int(r) for r in tensor.device_mesh.mesh.flatten().tolist()))
    if spanned and sorted(spanned) != sorted(ranks.members):
        raise FxdebugError(
            f"{type(model).__name__}'s device meshes hold ranks {ranks_text(sorted(spanned))}, "
            f"not the process group's {ranks_text(ranks.members)} (a pipeline stage?); the "
            f"unsharded copy gathers the same whole model on every rank of the group, so call "
            f"it where the model is sharded over the whole default group.")


def _full(tensor: Any) -> torch.Tensor:
    """The full value of ``tensor`` as a new plain tensor (a collective for a DTensor)."""
    with torch.no_grad():
        value = tensor.full_tensor() if is_dtensor(tensor) else tensor
        return value.detach().clone()


def unsharded_copy(model: torch.nn.Module, group=None) -> torch.nn.Module:
    """A plain module with ``model``'s structure, names and classes, every parameter and
    buffer its full value, FSDP2's and tensor parallelism's hooks left out (see the module
    doc). A collective: every rank of ``group`` (default: every rank) calls it.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> from torch.distributed.fsdp import fully_shard
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> _ = fully_shard(net, mesh=dist.device_mesh.init_device_mesh("cpu", (1,)))
    >>> plain = unsharded_copy(net)
    >>> type(plain).__name__, type(plain[0].weight).__name__, type(net[0].weight).__name__
    ('Sequential', 'Parameter', 'DTensor')
    >>> torch.equal(plain[0].weight, net[0].weight.full_tensor())
    True
    >>> dist.destroy_process_group()
    """
    ranks = RankGroup.of(group, what="fxdebug's unsharded copy")
    _, error = attempt(lambda: _check(model, ranks))
    raise_if_any_failed(ranks, error, f"copying {type(model).__name__} unsharded")
    full: dict[int, torch.Tensor] = {}
    for kind, _, tensor in _named_tensors(model):
        if id(tensor) not in full:
            value = _full(tensor)
            full[id(tensor)] = torch.nn.Parameter(value, requires_grad=tensor.requires_grad) \
                if kind == "parameter" else value
    return _copy(model, full, {})


def _copy(module: torch.nn.Module, full: dict[int, torch.Tensor],
          done: dict[int, torch.nn.Module]) -> torch.nn.Module:
    if id(module) in done:
        return done[id(module)]
    parameters = {name: None if p is None else full[id(p)]
                  for name, p in torch_compat.own_parameters(module).items()}
    buffers = {name: None if b is None else full.get(id(b), b)
               for name, b in torch_compat.own_buffers(module).items()}
    copied = torch_compat.module_shell(
        module, torch_compat.class_before_sharding(module), parameters, buffers, {},
        keep_hook=lambda hook: not torch_compat.registered_by_torch_distributed(hook))
    done[id(module)] = copied  # before the children: a module that holds itself holds its copy
    for name, child in torch_compat.own_children(module).items():
        if child is None:
            copied.register_module(name, None)  # an empty slot stays one
        else:
            torch_compat.set_child(copied, name, _copy(child, full, done))
    return copied


def eval_outputs(module: torch.nn.Module, inputs: tuple) -> list[torch.Tensor]:
    """The tensors of ``module(*inputs)`` (a DTensor as its full value), run in eval mode
    (each module's mode put back after), without grad, from the caller's random state, which
    is put back after (the CPU's and that of every CUDA device the module or inputs are on:
    two calls start from the same state), the parameters as they were after (FSDP2's shards
    registered again). A collective where ``module`` is sharded: every rank calls it.

    >>> [t.shape for t in eval_outputs(torch.nn.Linear(3, 2), (torch.ones(1, 3),))]
    [torch.Size([1, 2])]
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with kept_parameters(module), torch.no_grad(), \
                torch.random.fork_rng(devices=_cuda_devices(module, inputs)):
            return [_full(t) for _, t in flatten_tensors(module(*inputs))]
    finally:
        for m, mode in modes:
            m.training = mode


def _cuda_devices(module: torch.nn.Module, inputs: tuple) -> list[int]:
    """The CUDA devices of ``module``'s parameters and buffers and of ``inputs``' tensors."""
    tensors = [*module.parameters(), *module.buffers(), *(t for _, t in flatten_tensors(inputs))]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
