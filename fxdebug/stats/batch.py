"""Summaries of many small tensors at once: a fixed number of torch ops for any number of them.

:func:`batch_summaries` is the statistics engine of stats mode's small captures
(:mod:`fxdebug.runtime.stats_batch` collects them during a forward)::

    batch_summaries(tensors)
      ├─ one torch.cat of every value             (their dtype kept exact in float64)
      ├─ CPU: the tensors of each size as the rows of a matrix, reduced along the rows
      │    (min, max, mean, deviations' sum and squares, zeros): about 15 ops per size;
      │    other devices: segment reductions
      └─ one K x 8 float64 tensor: row i is tensor i's summary, the layout of
         :mod:`fxdebug.stats.summary` (count, mean, M2, min, max, zeros, non-finite, numel)

A row's reductions give the same bits whatever the other rows, so a tensor's
statistics do not depend on the other tensors of the batch. Rows with a NaN, an
Inf or an overflowing square take the masked ops over the finite values.
Nothing is read back to the host on a GPU. The plans (segment lengths, rows per
size) are kept per device and list of sizes, so the next batch of the same
shapes reuses them (and a CUDA graph captures no host-to-device copy: where none
is kept yet while a stream captures, they are built on the device).

>>> rows = batch_summaries([torch.tensor([1.0, 3.0, float("inf"), 0.0]), torch.arange(3)])
>>> [round(v, 4) for v in rows[0].tolist()]
[3.0, 1.3333, 4.6667, 0.0, 3.0, 1.0, 1.0, 4.0]
>>> rows[1].tolist()
[3.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 3.0]
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from contextlib import nullcontext

import torch

from ..base import torch_compat
from .kernel import MIN_NUMEL
from .summary import summarize

__all__ = ["batch_summaries", "batchable", "capturing", "capture_summary", "summarize_small",
           "BATCH_DTYPES", "CPU_BATCH_NUMEL"]

CPU_BATCH_NUMEL = 1 << 10
"""On the CPU only tensors smaller than this wait for the batch (elsewhere: ``MIN_NUMEL``). The
batch's float64 copy and per-size rows cost some 14 ns a value there (about 15 µs a tensor of
this size), a summary taken at once 5 to 15 µs (one call of the C kernel; 15 to 30 µs with
torch's reductions, where no C compiler builds it)."""
BATCH_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64,
                          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                          torch.bool))
"""Dtypes whose values float64 holds (integers up to 2**53 exactly): complex, float8 and
quantized tensors take :func:`fxdebug.stats.summary.summarize` one at a time."""
_PLANS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_PLANS_KEPT = 64
_LOCK = threading.Lock()
_INF = float("inf")
_NAN = float("nan")


def batchable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s summary is :func:`batch_summaries`' (small, plain, real dtype).

    >>> batchable(torch.ones(3)), batchable(torch.ones(1 << 20)), batchable(torch.ones(2, dtype=torch.cfloat))
    (True, False, False)
    >>> batchable(torch.ones(4096)), batchable(torch.ones(4096, device="meta"))  # CPU: summarized at once
    (False, False)
    """
    numel = tensor.numel()
    return (type(tensor) is torch.Tensor
            and (numel < CPU_BATCH_NUMEL or (numel < MIN_NUMEL and not tensor.is_cpu))
            and tensor.dtype in BATCH_DTYPES and tensor.layout == torch.strided
            and not tensor.is_meta)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream.

    >>> capturing(torch.device("cpu"))
    False
    """
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _lengths(device: torch.device, sizes: tuple[int, ...]) -> torch.Tensor:
    """The segment lengths ``sizes`` as an int64 tensor on ``device``, kept for the next call."""
    key = (str(device), sizes)
    with _LOCK:
        found = _PLANS.get(key)
        if found is not None:
            _PLANS.move_to_end(key)
            return found
    if capturing(device):  # no host-to-device copy inside a CUDA graph: fills on the device
        lengths = torch.cat([torch.full((1,), size, dtype=torch.int64, device=device)
                             for size in sizes])
        return lengths  # owned by the graph's memory pool: not kept
    lengths = torch.tensor(sizes, dtype=torch.int64).to(device)
    with _LOCK:
        _PLANS[key] = lengths
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return lengths


def _row_groups(sizes: tuple[int, ...]) -> tuple[list, torch.Tensor | None]:
    """The tensors of each size, as rows of a matrix: ``(groups, order)``, kept for the next call.

    ``groups`` holds ``(n, starts, count, zero)`` per size ``n``, in order of first
    appearance: ``starts`` is where each of that size's tensors begins among the values (a
    ``k x 1`` index; None where every tensor has that size: the values are the matrix),
    ``count`` is ``k`` times ``n`` and ``zero`` ``k`` zeros (float64 columns of the
    summaries); ``order`` puts the groups' rows back in the tensors' order (None for one
    group). Kept: a few numbers per tensor, never an index per value.
    """
    key = ("rows", sizes)
    with _LOCK:
        found = _PLANS.get(key)
        if found is not None:
            _PLANS.move_to_end(key)
            return found  # type: ignore[return-value]
    def columns(size: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full((rows,), float(size), dtype=torch.float64),
                torch.zeros(rows, dtype=torch.float64))

    if sizes.count(sizes[0]) == len(sizes):
        plan: tuple = ([(sizes[0], None, *columns(sizes[0], len(sizes)))], None)
    else:
        starts: dict[int, list[int]] = {}
        members: dict[int, list[int]] = {}
        offset = 0
        for index, size in enumerate(sizes):
            starts.setdefault(size, []).append(offset)
            members.setdefault(size, []).append(index)
            offset += size
        groups = [(size, torch.tensor(first, dtype=torch.int64)[:, None],
                   *columns(size, len(first))) for size, first in starts.items()]
        rows_in_order = [index for indices in members.values() for index in indices]
        order = torch.empty(len(sizes), dtype=torch.int64)
        order[torch.tensor(rows_in_order, dtype=torch.int64)] = torch.arange(len(sizes))
        plan = (groups, order)
    with _LOCK:
        _PLANS[key] = plan  # type: ignore[assignment]
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan


def _flat_float64(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every value of ``tensors``, in order, as one float64 tensor (exact for each dtype)."""
    dtype = tensors[0].dtype
    if all(t.dtype == dtype for t in tensors):
        return torch_compat.flatten_dense(tensors).to(torch.float64)
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


def batch_summaries(tensors: list[torch.Tensor], sizes: tuple[int, ...] | None = None,
                    values: torch.Tensor | None = None) -> torch.Tensor:
    """The summaries of ``tensors`` (on one device), one row each: a K x 8 float64 tensor.

    Row ``i`` equals ``summarize(tensors[i])`` within float64 rounding (see
    the module docstring). On the CPU one number is read back: where every
    value is finite and no square overflows (the common case) a dozen ops
    suffice; elsewhere, and on every other device (nothing read back), the
    masked ops over the finite values. ``sizes`` (each tensor's element count)
    and ``values`` (their values one after another, in their dtype) are taken
    where the caller has them.
    """
    device = tensors[0].device
    if sizes is None:
        sizes = tuple(t.numel() for t in tensors)
    total = sum(sizes)
    autocast_off = torch.autocast(device.type, enabled=False) \
        if torch.is_autocast_enabled(device.type) else nullcontext()
    with torch.no_grad(), autocast_off:
        if total == 0:
            numel = _lengths(device, sizes).to(torch.float64)
            empty = torch.full_like(numel, _NAN)
            return torch.stack([torch.zeros_like(numel), empty, empty,
                                torch.full_like(numel, _INF), torch.full_like(numel, -_INF),
                                empty, torch.zeros_like(numel), numel], dim=1)
        values = _flat_float64(tensors) if values is None else \
            values.reshape(-1).to(torch.float64)
        if device.type != "cpu":
            lengths = _lengths(device, sizes)
            return _masked(values, lengths, lengths.to(torch.float64), total)
        summaries = _all_finite(values, sizes)
        if math.isfinite(float(summaries.sum())):  # no NaN, Inf, empty tensor or overflow
            return summaries
        # the tensors whose row is not finite take the masked ops: each tensor's summary is
        # the same whatever else is in the batch
        redo = [int(i) for i in torch.nonzero(~torch.isfinite(summaries.sum(1))).reshape(-1)]
        if not redo:  # (the rows are finite, only their sum was too large)
            return summaries
        again = [tensors[i] for i in redo]
        sizes_again = tuple(sizes[i] for i in redo)
        lengths = torch.tensor(sizes_again, dtype=torch.int64)
        masked = _masked(_flat_float64(again), lengths, lengths.to(torch.float64),
                         sum(sizes_again))
        return summaries.index_copy(0, torch.tensor(redo, dtype=torch.int64), masked)


def _segment(data: torch.Tensor, lengths: torch.Tensor, reduce: str = "sum",
             initial: float = 0.0) -> torch.Tensor:
    """``reduce`` over each segment of ``data``'s rows (in a fixed order: deterministic)."""
    return torch.segment_reduce(data, reduce, lengths=lengths, unsafe=True, initial=initial)


def _all_finite(values: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The summaries where every value is finite: a row with a NaN or an Inf where not (a
    non-finite value, an empty tensor, squares that overflow float64).

    The tensors of one size are the rows of a matrix, reduced along each row: a row's
    sums are the same bits whatever the other rows (a tensor's statistics do not depend
    on the other captures of the batch).
    """
    groups: list[tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor]]
    groups, order = _row_groups(sizes)
    parts = [_rows_all_finite(values.view(-1, size) if starts is None
                              else values[starts + torch.arange(size)], size, count, zero)
             for size, starts, count, zero in groups]
    return parts[0] if order is None else torch.cat(parts).index_select(0, order)


def _rows_all_finite(rows: torch.Tensor, size: int, count: torch.Tensor,
                     zero: torch.Tensor) -> torch.Tensor:
    """:func:`_all_finite` of ``k`` tensors of ``size`` values each, the rows of ``rows``
    (``count``: ``k`` times ``size``, ``zero``: ``k`` zeros)."""
    if size == 0:  # nothing to reduce: the masked ops give an empty tensor's summary
        return count.new_full((rows.shape[0], 8), _NAN)
    low, high = rows.amin(1), rows.amax(1)
    mean = rows.sum(1, keepdim=True) / size
    deviation = rows - mean
    first, second = deviation.sum(1), (deviation * deviation).sum(1)
    zeros = count - rows.abs().sign().sum(1)  # (a finite value's |sign| is 1 unless it is 0)
    m2 = torch.addcmul(second, first, first, value=-1.0 / size).clamp_(min=0)
    corrected = torch.add(mean.view(-1), first, alpha=1.0 / size)
    return torch.stack([count, corrected, m2, low, high, zeros, zero, count], dim=1)


def _masked(values, lengths, numel, total) -> torch.Tensor:
    """The summaries over the finite values, branch-free (nothing read back; as
    :func:`fxdebug.stats.summary._summarize_masked`, a segment per tensor)."""
    finite = torch.isfinite(values)

    def spread(per_segment: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(per_segment, lengths, output_size=total)

    firsts = _segment(torch.stack([finite.double(), torch.where(finite, values, 0.0),
                                   (values == 0).double()], 1), lengths)
    count, zeros = firsts[:, 0], torch.where(numel > 0, firsts[:, 2], _NAN)
    safe = count.clamp(min=1)
    mean = firsts[:, 1] / safe
    low = _segment(torch.where(finite, values, _INF), lengths, "min", _INF)
    high = _segment(torch.where(finite, values, -_INF), lengths, "max", -_INF)
    # deviations from the float64 mean, scaled by the largest magnitude so their squares
    # cannot overflow, and corrected by their sum
    scale = torch.maximum(low.abs(), high.abs())
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, 1.0)
    deviation = torch.where(finite, (values - spread(mean)) / spread(scale), 0.0)
    sums = _segment(torch.stack([deviation, deviation * deviation], 1), lengths)
    m2 = ((sums[:, 1] - sums[:, 0] * sums[:, 0] / safe) * scale * scale).clamp(min=0)
    mean = torch.where(count > 0, mean + sums[:, 0] * scale / safe, _NAN)
    return torch.stack([count, mean, m2, low, high, zeros, numel - count, numel], dim=1)


def summarize_small(tensor: torch.Tensor) -> torch.Tensor | None:
    """The summary of one :func:`batchable` tensor as :func:`batch_summaries` gives it (the same
    numbers, whether it was summarized alone or in a batch); None for any other tensor.

    >>> summarize_small(torch.tensor([0.0, 2.0])).tolist()
    [2.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0]
    """
    return batch_summaries([tensor])[0] if batchable(tensor) else None


def capture_summary(tensor: torch.Tensor) -> torch.Tensor:
    """A stats-mode capture's summary: a small tensor's as in a batch of captures (the same
    numbers either way), others by :func:`~fxdebug.stats.summary.summarize`.

    >>> capture_summary(torch.ones(1 << 16)).tolist()
    [65536.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 65536.0]
    """
    small = summarize_small(tensor)
    return summarize(tensor) if small is None else small
