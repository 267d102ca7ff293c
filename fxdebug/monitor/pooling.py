"""Which rank's piece of a value counts in the global batch's statistics, from placements.

The global series are the statistics of the unsharded model on the concatenated batch, so
every value must count once, whatever copies the ranks hold. A rank's piece counts unless
it duplicates another rank's::

    RankLayout.of(model, ranks)        this rank's slot, the group's ranks, and the model's
                                       tensor-parallel group (from its ParallelStyle meshes)
    layout.parameter(tensor)           a parameter, its .grad, its update
      ├─ plain                         every rank holds it alike: the group's first rank's
      ├─ DTensor                       counts on the first copy of its mesh (the one holding
      │                                the group's first rank), where its coordinate is 0
      │                                on every Replicate mesh dim (Shard dims pool)
      └─ Partial                       a pending sum: left out of the global series
    layout.activation(placement)       a module output or its gradient (Records' placement)
      ├─ None (no tensor parallelism)  each rank holds its part of the batch: pools
      ├─ DTensor, or a ParallelStyle's
      │  declared layout               coordinate 0 on every Replicate dim counts; Shard
      │                                dims and the ranks outside the mesh (data-parallel
      │                                dims: other batches) pool; Partial: left out
      └─ local, layout unknown         pools, with the tensor-parallel group as its replica
                                       group: bitwise equal on every rank of the group =
                                       replicated, counts once (fxdebug.distributed.summaries)

>>> layout = RankLayout(slot=1, first_rank=0, tp_first=None, tp_why="no tensor parallelism")
>>> layout.parameter(torch.ones(2)).counts, layout.activation(None).counts
(False, True)
"""

from __future__ import annotations

import dataclasses

import torch

from ..distributed.summaries import NO_GROUP
from ..runtime import torch_compat
from ..runtime.placement import Placement, dtensor_placement

__all__ = ["Share", "RankLayout"]


@dataclasses.dataclass(frozen=True)
class Share:
    """How a rank's piece of one value enters the global summary.

    ``counts``: the piece is no copy of another rank's. ``group``: the slot of the first
    rank of its replica group (a value of undeclared layout: it counts once where the whole
    group holds the same numbers), or :data:`~fxdebug.distributed.summaries.NO_GROUP`.
    ``left_out``: why no faithful global value can be made of it (then it is none).
    """

    counts: bool
    group: int = NO_GROUP
    left_out: str = ""


def _mesh_ranks(mesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _partial(placement: Placement) -> str:
    names = [name or f"dim {i}" for i, (name, _) in enumerate(placement.mesh_dims)]
    dims = [names[d] if d < len(names) else f"dim {d}"
            for d, p in enumerate(placement.placements) if p.startswith("P")]
    if not dims:
        return ""
    return (f"a pending sum (Partial on mesh dim {', '.join(dims)}): each rank holds a term "
            f"of an unreduced sum, whose statistics are not the sum's; reducing it would cost "
            f"an all-reduce of the whole tensor")


def _off_first_replica(placement: Placement) -> bool:
    """Whether this rank's coordinate is not 0 on some Replicate mesh dim."""
    return any(p == "R" and d < len(placement.coordinate) and placement.coordinate[d] != 0
               for d, p in enumerate(placement.placements))


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """This rank's place for pooling: its slot in the monitor's group, the group's first
    (lowest) global rank, and the slot of the first rank of the model's tensor-parallel
    group (None: no tensor parallelism, or not known: ``tp_why`` says which)."""

    slot: int
    first_rank: int
    tp_first: int | None
    tp_why: str
    tensor_parallel: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module, ranks) -> "RankLayout":
        """The layout of ``model`` on ``ranks`` (a RankGroup, or None: one process).

        >>> RankLayout.of(torch.nn.Linear(2, 2), None).tp_why
        'no tensor parallelism'
        """
        slot = 0 if ranks is None else ranks.slot
        first = 0 if ranks is None else min(ranks.members)
        modules = [m for m in model.modules() if torch_compat.distribute_module_applied(m)]
        if not modules:
            return cls(slot, first, None, "no tensor parallelism")
        meshes = [layout.mesh for layout in map(torch_compat.parallel_output_layout, modules)
                  if layout is not None and layout.mesh is not None]
        groups = sorted({tuple(_mesh_ranks(mesh)) for mesh in meshes})
        if len(groups) != 1:
            why = ("its tensor-parallel modules' ParallelStyles could not be read" if not groups
                   else f"its ParallelStyles use {len(groups)} different meshes")
            return cls(slot, first, None, why, True)
        members = (0,) if ranks is None else ranks.members
        if not set(groups[0]) <= set(members):
            return cls(slot, first, None, f"its tensor-parallel mesh (ranks {list(groups[0])}) "
                                          f"is not inside the monitor's group", True)
        return cls(slot, first, members.index(min(groups[0])), "", True)

    def parameter(self, tensor: torch.Tensor) -> Share:
        """A parameter (its gradient, its update): every rank holds the plain ones alike."""
        placement = dtensor_placement(tensor)
        if placement is None:
            return Share(self.slot == 0)
        if not placement.known:
            return Share(False, left_out=placement.source)
        partial = _partial(placement)
        if partial:
            return Share(False, left_out=partial)
        first_copy = placement.mesh is None or min(_mesh_ranks(placement.mesh)) == self.first_rank
        return Share(first_copy and not _off_first_replica(placement))

    def activation(self, placement: Placement | None) -> Share:
        """A module output or its gradient, placed as its Record says."""
        if placement is None or (not placement.known and placement.local):
            if not self.tensor_parallel:
                return Share(True)
            if self.tp_first is None:
                return Share(False, left_out=f"a local tensor of undeclared layout in a "
                                             f"tensor-parallel model whose group is unknown "
                                             f"({self.tp_why})")
            return Share(True, group=self.tp_first)
        if not placement.known:
            return Share(False, left_out=placement.source)
        partial = _partial(placement)
        if partial:
            return Share(False, left_out=partial)
        return Share(not _off_first_replica(placement))
