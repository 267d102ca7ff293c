"""Statistics of many small tensors at once: a fixed number of torch ops for a whole forward.

Stats mode's captures of small tensors (fewer than ``MIN_NUMEL`` values: most
of a narrow model's activations, and on a GPU every one whose arithmetic costs
less than its launch) are not summarized one by one. Each capture keeps a
reference to its tensor and the tensor's version counter (a copy where a later
in-place op of the graph writes to it), and when the forward ends (the last
capture node says so), or when ``MAX_PENDING_NUMEL`` values are pending, or
before anything reads them, :func:`batch_summaries` computes them all::

    batch_summaries(tensors)                     K small tensors on one device
      ├─ one float64 buffer of all their values  (one cat; the values' dtype kept exact)
      ├─ segment reductions over it, K segments  (torch.segment_reduce, fixed order):
      │    finite count, mean, M2 about that mean (deviations, corrected by their
      │    sum, scaled by the largest magnitude), min, max, zeros
      └─ one K x 8 float64 tensor: row i is tensor i's summary, the layout of
         :mod:`.stats` (count, mean, M2, min, max, zeros, non-finite, numel)

About 25 ops whatever K is, nothing read back to the host: on a GPU, where a
small tensor's summary costs its launches, that is the difference between a
few microseconds a capture and a few hundred. The segment lengths are kept
per device and list of sizes, so the next forward of the same shapes reuses
them (and a CUDA graph captures no host-to-device copy: where none is kept
yet while a stream captures, they are built on the device).

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

from ..errors import FxdebugError
from .stats import combine, summarize
from .stats_kernel import MIN_NUMEL
from . import torch_compat

__all__ = ["batch_summaries", "batchable", "capturing", "capture_summary", "finish_pending", "summarize_small", "MAX_PENDING_NUMEL",
           "BATCH_DTYPES"]

MAX_PENDING_NUMEL = 1 << 21
"""Values kept pending at most: past it the pending summaries are computed at once."""

BATCH_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64,
                          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                          torch.bool))
"""Dtypes whose values float64 holds (integers up to 2**53 exactly): complex, float8 and
quantized tensors take :func:`fxdebug.runtime.stats.summarize` one at a time."""

_PLANS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_PLANS_KEPT = 64
_LOCK = threading.Lock()
_INF = float("inf")
_NAN = float("nan")


def batchable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s summary is :func:`batch_summaries`' (small, plain, real dtype).

    >>> batchable(torch.ones(3)), batchable(torch.ones(1 << 20)), batchable(torch.ones(2, dtype=torch.cfloat))
    (True, False, False)
    """
    return (type(tensor) is torch.Tensor and tensor.numel() < MIN_NUMEL
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


def _flat_float64(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every value of ``tensors``, in order, as one float64 tensor (exact for each dtype)."""
    dtype = tensors[0].dtype
    if all(t.dtype == dtype for t in tensors):
        return torch_compat.flatten_dense(tensors).to(torch.float64)
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


def batch_summaries(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The summaries of ``tensors`` (on one device), one row each: a K x 8 float64 tensor.

    Row ``i`` equals ``summarize(tensors[i])`` within float64 rounding (see
    the module docstring). On the CPU one number is read back: where every
    value is finite and no square overflows (the common case) a dozen ops
    suffice; elsewhere, and on every other device (nothing read back), the
    masked ops over the finite values.
    """
    device = tensors[0].device
    sizes = tuple(t.numel() for t in tensors)
    total = sum(sizes)
    autocast_off = torch.autocast(device.type, enabled=False) \
        if torch.is_autocast_enabled(device.type) else nullcontext()
    with torch.no_grad(), autocast_off:
        lengths = _lengths(device, sizes)
        numel = lengths.to(torch.float64)
        if total == 0:
            empty = torch.full_like(numel, _NAN)
            return torch.stack([torch.zeros_like(numel), empty, empty,
                                torch.full_like(numel, _INF), torch.full_like(numel, -_INF),
                                empty, torch.zeros_like(numel), numel], dim=1)
        values = _flat_float64(tensors)
        if device.type != "cpu":
            return _masked(values, lengths, numel, total)
        summaries, check = _all_finite(values, lengths, numel, total)
        if math.isfinite(float(check.sum())):  # no NaN, Inf, empty tensor or overflow
            return summaries
        # the tensors that have one take the masked ops: each tensor's summary is the same
        # whatever else is in the batch
        redo = [int(i) for i in torch.nonzero(~torch.isfinite(check)).reshape(-1)]
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


def _all_finite(values, lengths, numel, total) -> tuple[torch.Tensor, torch.Tensor]:
    """The summaries where every value is finite, and per tensor a number finite only if so."""
    low = _segment(values, lengths, "min", _INF)
    high = _segment(values, lengths, "max", -_INF)
    mean = _segment(values, lengths) / numel
    deviation = values - torch.repeat_interleave(mean, lengths, output_size=total)
    sums = _segment(torch.stack([deviation, deviation * deviation, (values == 0).double()], 1),
                    lengths)
    m2 = (sums[:, 1] - sums[:, 0] * sums[:, 0] / numel).clamp(min=0)
    summaries = torch.stack([numel, mean + sums[:, 0] / numel, m2, low, high, sums[:, 2],
                             torch.zeros_like(numel), numel], dim=1)
    return summaries, high - low + sums[:, 1]


def _masked(values, lengths, numel, total) -> torch.Tensor:
    """The summaries over the finite values, branch-free (nothing read back; as
    :func:`fxdebug.runtime.stats._summarize_masked`, a segment per tensor)."""
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
    numbers either way), others by :func:`~fxdebug.runtime.stats.summarize`.

    >>> capture_summary(torch.ones(1 << 16)).tolist()
    [65536.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 65536.0]
    """
    small = summarize_small(tensor)
    return summarize(tensor) if small is None else small


def finish_pending(tensors: list[torch.Tensor], versions: list, previous: list,
                   accumulating: bool = False
                   ) -> tuple[list[tuple[list[int], torch.Tensor]], list[int], bool]:
    """The summaries of pending captures: ``(groups, stale, graphed)``.

    ``groups`` holds ``(indices, K x 8 rows)`` per device (one group where all
    tensors share one), ``previous[i]`` (a summary of earlier runs, where
    accumulating) merged in; ``stale`` the indices whose tensor's version
    moved since its capture (``versions``), to show no statistics; ``graphed``
    whether a CUDA graph is being captured.

    >>> a, b = torch.ones(2), torch.zeros(3)
    >>> versions = torch_compat.tensor_versions([a, b])
    >>> _ = b.add_(1)  # written after its capture: no statistics
    >>> groups, stale, graphed = finish_pending([a, b], versions, [None, None])
    >>> groups[0][1][0].tolist()[:2], stale, graphed
    ([2.0, 1.0], [1], False)
    """
    now = torch_compat.tensor_versions(tensors)
    stale = [] if now == versions else [i for i, (v, w) in enumerate(zip(versions, now)) if v != w]
    stale += [i for i, earlier in enumerate(previous) if isinstance(earlier, str)]
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        parts = [(device, list(range(len(tensors))))]
    else:
        by_device: dict[torch.device, list[int]] = {}
        for index, tensor in enumerate(tensors):
            by_device.setdefault(tensor.device, []).append(index)
        parts = list(by_device.items())
    groups, graphed = [], False
    for device, indices in parts:
        if capturing(device):
            graphed = True
            if accumulating:
                raise FxdebugError(
                    "fxdebug.accumulate_stats cannot run inside a CUDA graph: a replay runs no "
                    "Python, so it cannot count its runs or merge them. Capture the graph from a "
                    "module without accumulate_stats (records(gm) after each replay holds that "
                    "replay's statistics), or run the accumulating module eagerly.")
        rows = batch_summaries([tensors[i] for i in indices])
        merged = [row for row, i in enumerate(indices) if isinstance(previous[i], torch.Tensor)]
        if merged:
            earlier = torch.stack([previous[indices[row]].to(device) for row in merged])
            where = torch.tensor(merged, dtype=torch.int64).to(device)
            rows = rows.index_copy(0, where, combine(earlier, rows.index_select(0, where)))
        groups.append((indices, rows))
    return groups, stale, graphed
