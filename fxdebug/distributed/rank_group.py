"""What the rank analyses share: the process group, its ranks, wrapped models, local shards.

Everything here is public ``torch.distributed`` (``is_initialized``,
``get_process_group_ranks``, ``all_gather_object``, ``DTensor.to_local``,
``DeviceMesh.get_coordinate``)::

    RankGroup.of(group)          the group (WORLD by default), its global ranks in group
      │                          order, this process's place in it; an error that says
      │                          how to initialise torch.distributed when it is not
      ├─ .gather(obj)            all_gather_object: every rank's obj, in group order
      └─ .rank                   this process's global rank
    unwrap(model)                DistributedDataParallel / DataParallel -> the module inside
    local_view(tensor)           a DTensor's local shard and which replicas must equal it

>>> unwrap(torch.nn.Linear(2, 2))[1]
''
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import FxdebugError

__all__ = ["RankGroup", "distributed_ready", "unwrap", "local_view", "ranks_text", "on_ranks"]

_NOT_READY = (
    "{what} is a collective: every rank calls it, after "
    "torch.distributed.init_process_group(...). torch.distributed is not initialised in this "
    "process{where}. Under torchrun, call torch.distributed.init_process_group('gloo') (or "
    "'nccl') first; alone, a world of one rank works too: "
    "torch.distributed.init_process_group('gloo', store=torch.distributed.HashStore(), rank=0, "
    "world_size=1).")


def distributed_ready() -> bool:
    """Whether ``torch.distributed`` is built in and initialised in this process.

    >>> isinstance(distributed_ready(), bool)
    True
    """
    distributed = getattr(torch, "distributed", None)
    return bool(distributed is not None and distributed.is_available()
                and distributed.is_initialized())


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """A process group as the rank analyses use it.

    ``members`` are the global ranks of the group, in group order; ``slot`` is this
    process's index in it, ``rank`` its global rank.
    """

    group: Any
    members: tuple[int, ...]
    slot: int

    @property
    def rank(self) -> int:
        return self.members[self.slot]

    @property
    def size(self) -> int:
        return len(self.members)

    @classmethod
    def of(cls, group=None, what: str = "this call", where: str = "") -> "RankGroup":
        """The group ``group`` (None: the default group, every rank)."""
        if not distributed_ready():
            raise FxdebugError(_NOT_READY.format(what=what, where=f" ({where})" if where else ""))
        import torch.distributed as dist
        group = group if group is not None else dist.group.WORLD
        members = tuple(int(r) for r in dist.get_process_group_ranks(group))
        me = dist.get_rank()
        if me not in members:
            at = f" ({where})" if where else ""
            raise FxdebugError(f"{what}: rank {me} is not a member of the process group it was "
                               f"given (ranks {ranks_text(members)}){at}; call it on the "
                               f"group's ranks only, or pass group=None.")
        return cls(group, members, members.index(me))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable, small), in group order: one collective."""
        import torch.distributed as dist
        found: list[Any] = [None] * self.size
        dist.all_gather_object(found, obj, group=self.group)
        return found

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """``tensor`` reduced in place over the group (``op``: "sum" or "max"); with
        ``async_op`` the work handle to ``wait()`` on, else None."""
        import torch.distributed as dist
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=async_op)

    def backend_device(self, device: torch.device) -> torch.device:
        """Where a tensor must be for a collective on this group: the CPU for gloo,
        ``device`` otherwise."""
        import torch.distributed as dist
        backend = str(dist.get_backend(self.group)).lower()
        return torch.device("cpu") if backend == "gloo" else device


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``(the module a data-parallel wrapper runs, the wrapper's class name)``; ``(model, "")``
    for any other module. The wrapper's own parameters are its module's (``module.`` prefixed).
    """
    wrappers: list[type[torch.nn.Module]] = [torch.nn.DataParallel]
    if getattr(torch, "distributed", None) is not None and torch.distributed.is_available():
        wrappers.append(torch.nn.parallel.DistributedDataParallel)
    inner = getattr(model, "module", None)
    if isinstance(model, tuple(wrappers)) and isinstance(inner, torch.nn.Module):
        return inner, type(model).__name__
    return model, ""


def local_view(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple, str]:
    """``(local data, replica class, placement text)`` of a tensor on this rank.

    A plain tensor is its own data; every rank of the group holds a copy, so its
    replica class is ``()``. A ``DTensor`` (FSDP2's parameters, tensor parallelism)
    holds its local shard: ranks with the same coordinates along the mesh dimensions
    that shard it (``Shard``) or hold a pending sum (``Partial``) must hold equal data,
    so the class is those coordinates; along ``Replicate`` dimensions the copies must
    agree.

    >>> local_view(torch.ones(2))[1:]
    ((), '')
    """
    to_local = getattr(tensor, "to_local", None)
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    if to_local is None or placements is None or mesh is None:
        return tensor, (), ""
    coordinate = mesh.get_coordinate() or []
    klass = tuple((dim, int(coordinate[dim])) for dim, placement in enumerate(placements)
                  if not placement.is_replicate() and dim < len(coordinate))
    return to_local(), klass, ", ".join(str(p) for p in placements)


def ranks_text(ranks) -> str:
    """``0, 2, 3`` (ranks in the order given).

    >>> ranks_text([0, 2]), ranks_text([])
    ('0, 2', 'none')
    """
    return ", ".join(str(r) for r in ranks) or "none"


def on_ranks(ranks) -> str:
    """``rank 1`` or ``ranks 0, 2``.

    >>> on_ranks([1]), on_ranks((0, 2))
    ('rank 1', 'ranks 0, 2')
    """
    ranks = list(ranks)
    return f"rank{'' if len(ranks) == 1 else 's'} {ranks_text(ranks)}"
