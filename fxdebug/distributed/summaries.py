"""Moment summaries of every rank, merged into the global batch's: the monitor's collective.

Call tree (every rank, on a logged step of :func:`fxdebug.monitor`)::

    reduce_summaries(ranks, names, rows, groups, error)
      ├─ agreement: each rank's (failed?, slot count, checksum of the slot names) in its
      │    own slots of a 3 x world vector, one all_reduce (SUM): every rank learns
      │    whether every rank is ready, and with the same slots; if not, every rank
      │    raises (the failing one its own error): no rank waits in a collective that
      │    another will never call
      └─ summaries: each rank's K x 10 rows, and per row its replica group, in its slot of
           a world x K x 11 tensor, one all_reduce (SUM: a NaN or Inf stays in its own
           slot); then merge_ranks, the same on every rank, on the device

What a rank sends is its *share* of each value: the summary of the pieces that are no
copy of another rank's (an empty summary where all it holds is a copy: a replicated
parameter on any rank but the first, a Replicate DTensor's piece off coordinate 0). Which
pieces those are follows from placements, on each rank alone (see
:mod:`fxdebug.monitoring.pooling`). Where a rank cannot know (a plain activation of a
tensor-parallel model, layout undeclared), it names its *replica group* (the slot of the
first rank of its tensor-parallel group): if every rank of that group sent the same ten
numbers, bit for bit, the value is replicated there and counts once (the group's first
rank's); otherwise each rank's is a piece of it and all count. Everything else pools.

>>> rows = torch.tensor([[2.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0, 0.0, 2.0]])
>>> merge_ranks(torch.stack([rows, rows]))[0, :3].tolist()
[4.0, 1.0, 4.0]
>>> merge_ranks(torch.stack([rows, rows]), torch.tensor([[0.0], [0.0]]))[0, :3].tolist()
[2.0, 1.0, 2.0]
>>> merge_ranks(torch.stack([rows, empty_summaries(1)]))[0, :3].tolist()
[2.0, 1.0, 2.0]
"""

from __future__ import annotations

import zlib

import torch

from ..errors import FxdebugError
from ..stats.moments import MOMENT_COLUMNS, combine_moments
from .rank_group import RankGroup, on_ranks

__all__ = ["reduce_summaries", "merge_ranks", "empty_summaries", "NO_GROUP"]

_WIDTH = len(MOMENT_COLUMNS)
NO_GROUP = -1
"""A row's replica group when its share is known on the rank itself (pool it as sent)."""


def empty_summaries(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` moment summaries of no value at all: merging one changes nothing.

    >>> empty_summaries(1)[0].tolist()
    [0.0, 0.0, 0.0, inf, -inf, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    empty = torch.zeros(count, _WIDTH, dtype=torch.float64, device=device)
    empty[:, 3] = float("inf")
    empty[:, 4] = float("-inf")
    return empty


def merge_ranks(per_rank: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
    """``world x K x 10`` rows -> the ``K x 10`` global rows, merged in rank order.

    ``groups`` (``world x K``, or None: every row pools): per rank and row, the slot of the
    first rank of its replica group, or :data:`NO_GROUP`. A rank of a group whose ranks all
    hold bitwise the same row is left out, but the group's first.
    """
    world, count = per_rank.shape[0], per_rank.shape[1]
    rows = per_rank
    if groups is not None and count:
        groups = groups.to(per_rank.device)
        slots = torch.arange(world, device=per_rank.device).unsqueeze(-1).expand(world, count)
        grouped = groups >= 0
        first = torch.where(grouped, groups.round().long().clamp(0, world - 1), slots)
        theirs = rows.gather(0, first.unsqueeze(-1).expand(world, count, _WIDTH))
        same = ((rows == theirs) | (rows.isnan() & theirs.isnan())).all(-1)
        all_same = torch.ones(world, count, dtype=torch.float64, device=per_rank.device)
        all_same = all_same.scatter_reduce(0, first, same.to(torch.float64), "amin")
        copy = grouped & (first != slots) & (all_same.gather(0, first) > 0)
        rows = torch.where(copy.unsqueeze(-1), empty_summaries(1, per_rank.device), rows)
    merged = rows[0]
    for slot in range(1, world):
        merged = combine_moments(merged, rows[slot])
    return merged


def reduce_summaries(ranks: RankGroup, names: list[str], rows: torch.Tensor | None,
                     groups: list[int] | None = None, error: BaseException | None = None,
                     what: str = "fxdebug.monitor") -> torch.Tensor:
    """The global rows of ``names`` (``K x 10``, float64, on ``rows``' device) from every
    rank's ``rows`` (its shares, see the module's text); a collective: every rank calls it
    with the same names.

    ``groups``: per row, this rank's replica group (the slot of its first rank) or
    :data:`NO_GROUP` (None: every row pools). ``error``: this rank could not make its
    rows; it still takes part, and every rank raises :class:`~fxdebug.errors.FxdebugError`
    saying which rank failed (this one: with its own error as the cause)."""
    import torch.distributed as dist
    device = rows.device if rows is not None else torch.device("cpu")
    wire = ranks.backend_device(device)
    checksum = float(zlib.crc32("\n".join(names).encode()))
    header = torch.zeros(3 * ranks.size, dtype=torch.float64, device=wire)
    failed = error is not None or rows is None
    header[3 * ranks.slot:3 * ranks.slot + 3] = torch.tensor(
        [1.0 if failed else 0.0, float(len(names)), checksum], dtype=torch.float64)
    dist.all_reduce(header, group=ranks.group)
    seen = header.view(ranks.size, 3).tolist()
    broken = [rank for rank, (bad, _, _) in zip(ranks.members, seen) if bad]
    if broken:
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        raise FxdebugError(
            f"{what}: the step's statistics failed on {on_ranks(broken)}{cause}; every rank "
            f"stops here instead of waiting for it. The failing rank's error says what to "
            f"fix; the other ranks raise this same error.") from error
    if len({(count, check) for _, count, check in seen}) > 1:
        counts = ", ".join(f"rank {rank}: {int(count)}" for rank, (_, count, _)
                           in zip(ranks.members, seen))
        raise FxdebugError(
            f"{what}: the ranks recorded different keys this step ({counts} statistics, or "
            f"the same number under other names); every rank must run the same model with "
            f"the same select= (a rank that skipped a module, or ran a forward the others "
            f"did not, differs). Monitor the same modules on every rank.")
    payload = torch.zeros(ranks.size, len(names), _WIDTH + 1, dtype=torch.float64, device=wire)
    if rows is not None:  # (always, once no rank failed)
        payload[ranks.slot, :, :_WIDTH] = rows.to(wire)
        payload[ranks.slot, :, _WIDTH] = NO_GROUP if groups is None else torch.tensor(
            groups, dtype=torch.float64)
    dist.all_reduce(payload, group=ranks.group)
    return merge_ranks(payload[..., :_WIDTH], payload[..., _WIDTH]).to(device)
