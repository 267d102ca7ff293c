"""Live Records of a sharded model, made whole for :func:`~fxdebug.compare_runs`.

Under tensor or sequence parallelism ``fxdebug.records(gm)`` holds this rank's piece of
each capture, with its placement (:mod:`fxdebug.runtime.placement`). ``compare_runs``
given such Records on every rank gathers every rank's pieces (one ``all_gather_object``
of the default process group, a collective every rank calls) and reads them as a run
saved by every rank (:class:`~fxdebug.distributed.sharded.ShardedRecords`): each key assembled
on its mesh, and a divergence names the ranks whose piece holds it::

    gathered(records)   Records with a placement, under a process group of several ranks:
                        ShardedRecords of every rank's pieces (values copied to the CPU);
                        (``records(gm)`` of ``instrument(folder=)`` too: this rank's run read
                        back); any other Records (an unsharded run, FSDP2 or DDP captures,
                        one process, a folder another rank or job saved): as they are

Every rank must call it with Records of the same model (the decision to gather is made
from the Records alone, the same on every rank of a job that runs one model). Each rank
then holds every rank's pieces: memory grows with the world size.

>>> import torch, fxdebug
>>> gm = fxdebug.instrument(torch.nn.Linear(2, 1))
>>> _ = gm(torch.ones(1, 2))
>>> gathered(fxdebug.records(gm)) is fxdebug.records(gm)
True
"""

from __future__ import annotations

import copy

import torch

from ..runtime.placement import local_value
from ..runtime.records import Records
from .sharded import ShardedRecords
from .sharded_stats import local_shape

__all__ = ["gathered", "is_sharded"]

def _sections(records: Records) -> list[tuple[str, Records]]:
    found = [("records", records)]
    if records._grads is not None and len(records._grads):
        found.append(("grads", records._grads))
    return found


def is_sharded(records: Records) -> bool:
    """Whether ``records`` are one rank's captures of a sharded model, to be gathered."""
    if isinstance(records, ShardedRecords) or not torch.distributed.is_available() \
            or not torch.distributed.is_initialized() or torch.distributed.get_world_size() < 2:
        return False
    context = getattr(records, "context", None)  # a saved run: written by this rank of this job
    if context is not None and (context.get("rank"), context.get("world_size")) != (
            torch.distributed.get_rank(), torch.distributed.get_world_size()):
        return False
    return any(record.placement is not None
               for _, section in _sections(records) for record in section.records())


def _portable(records: Records) -> tuple[Records, dict[tuple[str, str], tuple[int, ...] | None]]:
    """A copy of ``records`` that pickles: local pieces on the CPU, no parameters, no mesh;
    and the global ranks of each capture's mesh."""
    out = Records(records._grads_recorded)
    out.locations = dict(records.locations)
    out.notes = list(records.notes)
    out.step = records.step
    mesh_ranks: dict[tuple[str, str], tuple[int, ...] | None] = {}
    saved = getattr(records, "mesh_ranks", {})  # records(gm) of instrument(folder=): read back, no mesh
    for section, source in _sections(records):
        target = out if section == "records" else out.grads
        for key in source.keys():
            record = source.record(key)
            moved = copy.copy(record)
            placement = record.placement
            if record.value is not None:
                if record.stale:  # never shown: kept stale (empty, a version it cannot have)
                    moved.value, moved.version = torch.empty(0, dtype=record.dtype), -1
                else:  # a snapshot now: the copy sent has no version counter to follow
                    moved.value, moved.version = local_value(record.value).detach().cpu(), None
                    moved.shape = tuple(moved.value.shape)  # a DTensor's is global: the piece's
            elif placement is not None and not placement.local and placement.known:
                # a DTensor's statistics are its piece's: so is the shape they are assembled by
                moved.shape = local_shape(tuple(record.shape), placement.placements,
                                          tuple(n for _, n in placement.mesh_dims),
                                          placement.coordinate)
            mesh = None if record.placement is None else record.placement.mesh
            mesh_ranks[(section, key)] = saved.get((section, key)) \
                if mesh is None or not hasattr(mesh, "mesh") \
                else tuple(int(r) for r in mesh.mesh.flatten().tolist())
            target._records[key] = moved
    return out, mesh_ranks


def gathered(records: Records) -> Records:
    """Every rank's pieces of sharded live ``records`` as :class:`ShardedRecords` (a
    collective); other Records as they are."""
    if not is_sharded(records):
        return records
    world = torch.distributed.get_world_size()
    pieces: list = [None] * world
    torch.distributed.all_gather_object(pieces, _portable(records))
    ranks = {rank: piece[0] for rank, piece in enumerate(pieces)}
    mesh_ranks = {rank: piece[1] for rank, piece in enumerate(pieces)}
    label = f"Records in memory, gathered from ranks 0-{world - 1}"
    context = dict(getattr(records, "context", None) or {}, rank=None, ranks=list(ranks))
    return ShardedRecords(label, ranks, context, mesh_ranks)
