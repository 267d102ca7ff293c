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
      │                                on every Replicate mesh dim (Shard dims, FSDP's
      │                                _StridedShard too, pool)
      └─ Partial                       a pending sum: left out of the global series
    layout.activation(value, placement)  a module output or its gradient
      ├─ plain, no tensor parallelism  each rank holds its part of the batch: pools
      ├─ DTensor (its placements), or
      │  a ParallelStyle's declared
      │  layout (Records' placement)   coordinate 0 on every Replicate dim counts; Shard
      │                                dims and the ranks outside the mesh (data-parallel
      │                                dims: other batches) pool; Partial: left out
      └─ local, layout unknown         pools, with the tensor-parallel group as its replica
                                       group: bitwise equal on every rank of the group =
                                       replicated, counts once (fxdebug.distributed.summaries)

>>> layout = RankLayout(slot=1, first_rank=0, tp_first=None, tp_why="no tensor parallelism")
>>> layout.parameter(torch.ones(2)).counts, layout.activation(torch.ones(2)).counts
(False, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..distributed.summaries import NO_GROUP
from ..base import torch_compat
from ..runtime.placement import Placement

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


def _dims(placements) -> tuple[str, ...]:
    """Per mesh dim ``"R"`` (copies), ``"P"`` (terms of a pending sum) or ``"S"`` (disjoint
    pieces: ``Shard``, FSDP's ``_StridedShard``, any other split), from DTensor placements or
    :class:`~fxdebug.runtime.placement.Placement` texts."""
    out = []
    for p in placements:
        if isinstance(p, str):
            out.append("R" if p == "R" else "P" if p.startswith("P") else "S")
        else:
            out.append("R" if p.is_replicate() else "P" if p.is_partial() else "S")
    return tuple(out)


def _placed(dims: tuple[str, ...], coordinate, names, first_copy: bool = True) -> Share:
    """A value placed ``dims`` on a mesh where this rank sits at ``coordinate``."""
    partial = [names[d] if d < len(names) and names[d] else f"dim {d}"
               for d, p in enumerate(dims) if p == "P"]
    if partial:
        return Share(False, left_out=(
            f"a pending sum (Partial on mesh dim {', '.join(partial)}): each rank holds a term "
            f"of an unreduced sum, whose statistics are not the sum's; reducing it would cost "
            f"an all-reduce of the whole tensor"))
    copy = any(p == "R" and d < len(coordinate) and coordinate[d] != 0
               for d, p in enumerate(dims))
    return Share(first_copy and not copy)


def _dtensor(tensor) -> bool:
    return type(tensor) is not torch.Tensor and hasattr(tensor, "placements") \
        and hasattr(tensor, "device_mesh")


def _mesh_place(mesh) -> tuple[tuple[int, ...], tuple[str, ...]]:
    names = tuple(str(n) for n in (getattr(mesh, "mesh_dim_names", None) or ()))
    return tuple(int(c) for c in (mesh.get_coordinate() or ())), names


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
        if not _dtensor(tensor):
            return Share(self.slot == 0)
        placed: Any = tensor
        coordinate, names = _mesh_place(placed.device_mesh)
        first_copy = min(_mesh_ranks(placed.device_mesh)) == self.first_rank
        return _placed(_dims(placed.placements), coordinate, names, first_copy)

    def activation(self, value, placement: Placement | None = None) -> Share:
        """A module output or its gradient: a DTensor by its placements, a plain tensor as
        its Record's ``placement`` says (a ParallelStyle's declared layout, or unknown)."""
        if _dtensor(value):
            return _placed(_dims(value.placements), *_mesh_place(value.device_mesh))
        if placement is not None and placement.known:
            names = tuple(name for name, _ in placement.mesh_dims)
            return _placed(_dims(placement.placements), placement.coordinate, names)
        if not self.tensor_parallel:
            return Share(True)
        if self.tp_first is None:
            return Share(False, left_out=f"a local tensor of undeclared layout in a "
                                         f"tensor-parallel model whose group is unknown "
                                         f"({self.tp_why})")
        return Share(True, group=self.tp_first)
