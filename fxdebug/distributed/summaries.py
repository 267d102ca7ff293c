"""Moment summaries of every rank, merged into the global batch's: the monitor's collective.

Call tree (every rank, on a logged step of :func:`fxdebug.monitor`)::

    reduce_summaries(ranks, names, rows, pooled, error)
      ├─ agreement: each rank's (failed?, slot count, checksum of the slot names) in its
      │    own slots of a 3 x world vector, one all_reduce (SUM): every rank learns
      │    whether every rank is ready, and with the same slots; if not, every rank
      │    raises (the failing one its own error): no rank waits in a collective that
      │    another will never call
      └─ summaries: each rank's K x 10 rows in its slot of a world x K x 10 tensor,
           one all_reduce (SUM: a NaN or Inf stays in its own slot); then, in rank
           order, pooled rows merged exactly (fxdebug.runtime.stats_moments.combine_moments:
           count, mean, M2, M3, M4; min, max, zeros, non-finite reduced), replicated rows
           (DDP's parameters, their averaged gradients) taken from the group's first rank

>>> rows = torch.tensor([[2.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0, 0.0, 2.0]])
>>> merge_ranks(torch.stack([rows, rows]), [True])[0, :3].tolist()
[4.0, 1.0, 4.0]
>>> merge_ranks(torch.stack([rows, rows]), [False])[0, :3].tolist()
[2.0, 1.0, 2.0]
"""

from __future__ import annotations

import zlib

import torch

from ..errors import FxdebugError
from ..runtime.stats_moments import MOMENT_COLUMNS, combine_moments
from .rank_group import RankGroup, on_ranks

__all__ = ["reduce_summaries", "merge_ranks"]

_WIDTH = len(MOMENT_COLUMNS)


def merge_ranks(per_rank: torch.Tensor, pooled: list[bool]) -> torch.Tensor:
    """``world x K x 10`` rows -> the ``K x 10`` global rows: pooled rows merged in rank order,
    the others the first rank's."""
    merged = per_rank[0]
    for slot in range(1, per_rank.shape[0]):
        merged = combine_moments(merged, per_rank[slot])
    keep = torch.tensor(pooled, dtype=torch.bool, device=per_rank.device).unsqueeze(-1)
    return torch.where(keep, merged, per_rank[0])


def reduce_summaries(ranks: RankGroup, names: list[str], rows: torch.Tensor | None,
                     pooled: list[bool], error: BaseException | None = None,
                     what: str = "fxdebug.monitor") -> torch.Tensor:
    """The global rows of ``names`` (``K x 10``, float64, on ``rows``' device) from every
    rank's ``rows``; a collective: every rank calls it with the same names.

    ``error``: this rank could not make its rows; it still takes part, and every rank
    raises :class:`~fxdebug.errors.FxdebugError` saying which rank failed (this one:
    with its own error as the cause)."""
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
    payload = torch.zeros(ranks.size, len(names), _WIDTH, dtype=torch.float64, device=wire)
    if rows is not None:  # (always, once no rank failed)
        payload[ranks.slot] = rows.to(wire)
    dist.all_reduce(payload, group=ranks.group)
    return merge_ranks(payload, pooled).to(device)
