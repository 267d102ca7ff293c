"""Statistics of many small tensors at once: a fixed number of torch ops for a whole forward.

Stats mode's captures of small tensors (fewer than ``MIN_NUMEL`` values, on the
CPU ``CPU_BATCH_NUMEL``: most of a narrow model's activations, and on a GPU every
one whose arithmetic costs less than its launch) are not summarized one by one. Each capture appends its
tensor (a copy where a later in-place op of the graph writes to it) and its
version counter to a :class:`PendingBatch`, and its place to the Records' list of
pending captures; when the forward ends (the last capture node says so), or when
``MAX_PENDING_NUMEL`` values are pending, or before anything reads them,
:func:`batch_summaries` computes them all and the tensors are let go. The
Records themselves are made when first read::

    capture_stats(recorder, t, key, op)           per capture: a few list appends
    ...
    last capture: PendingBatch.finish()
      ├─ finish_pending: versions read again      a tensor written since is stale
      ├─ one torch.cat of every value             (their dtype kept exact in float64)
      └─ batch_summaries                          CPU: the tensors of each size as the rows
           │                                      of a matrix, reduced along the rows
           │                                      (min, max, mean, deviations' sum and
           │                                      squares, zeros): about 15 ops per size;
           │                                      other devices: segment reductions
           └─ one K x 8 float64 tensor: row i is tensor i's summary, the layout of
              :mod:`fxdebug.stats.summary` (count, mean, M2, min, max, zeros, non-finite, numel)

A row's reductions give the same bits whatever the other rows, so a tensor's
statistics do not depend on the other captures of the forward. Rows with a
NaN, an Inf or an overflowing square take the masked ops over the finite values.
Nothing is read back to the host on a GPU: there, where a small tensor's summary
costs its launches, that is the difference between a few microseconds a capture
and a few hundred. The plans (segment lengths, rows per size) are kept per device
and list of sizes, so the next forward of the same shapes reuses them (and a CUDA
graph captures no host-to-device copy: where none is kept yet while a stream
captures, they are built on the device).

>>> rows = batch_summaries([torch.tensor([1.0, 3.0, float("inf"), 0.0]), torch.arange(3)])
>>> [round(v, 4) for v in rows[0].tolist()]
[3.0, 1.3333, 4.6667, 0.0, 3.0, 1.0, 1.0, 4.0]
>>> rows[1].tolist()
[3.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 3.0]
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from contextlib import nullcontext

import torch

from ..errors import FxdebugError
from .record import BatchedStatsRecord, Record, StaleStatsRecord, _new_record
from ..stats.summary import combine, summarize
from ..stats.kernel import MIN_NUMEL
from ..base import torch_compat

__all__ = ["batch_summaries", "batchable", "capturing", "capture_summary", "finish_pending",
           "summarize_small", "merge_runs", "PendingBatch", "SMALL", "READY", "MAX_PENDING_NUMEL",
           "BATCH_DTYPES", "CPU_BATCH_NUMEL"]

MAX_PENDING_NUMEL = 1 << 21
"""Values kept pending at most: past it the pending summaries are computed at once."""

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

SMALL = "small capture, summary pending"
"""The kind of a Records.pending entry ``(key, op, PendingBatch, SMALL, index)``."""
READY = "capture summarized at once"
"""The kind of a Records.pending entry ``(key, op, Record, READY, None)``."""

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


def finish_pending(tensors: list, versions: list, dtypes: list, sizes: list,
                   accumulating: bool = False
                   ) -> tuple[list[tuple[list[int], torch.Tensor]], list[int], bool,
                              torch.Size | None]:
    """The summaries of pending captures: ``(groups, stale, graphed, trailing)``.

    ``groups`` holds ``(indices, K x 8 rows)`` per device (one group where all
    tensors share one); ``stale`` the indices whose tensor's version moved
    since its capture (``versions``), to show no statistics; ``graphed``
    whether a CUDA graph is being captured; ``trailing`` the sizes every tensor
    has beyond its first dimension, where they share them (else None).
    ``dtypes`` and ``sizes`` are the tensors' dtypes and element counts.

    >>> a, b = torch.ones(2), torch.zeros(3)
    >>> versions = torch_compat.tensor_versions([a, b])
    >>> _ = b.add_(1)  # written after its capture: no statistics
    >>> groups, stale, graphed, trailing = finish_pending([a, b], versions, [a.dtype, b.dtype], [2, 3])
    >>> groups[0][1][0].tolist()[:2], stale, graphed, trailing
    ([2.0, 1.0], [1], False, torch.Size([]))
    """
    now = torch_compat.tensor_versions(tensors)
    stale = [] if now == versions else \
        [i for i, (v, w) in enumerate(zip(versions, now)) if v != w]
    device = tensors[0].device
    try:  # one copy of every value where all share one dtype and their sizes beyond dim 0
        with torch.no_grad():
            flat = torch.cat(tensors) if dtypes.count(dtypes[0]) == len(dtypes) else None
    except RuntimeError:  # (torch.cat refuses other sizes, 0-d tensors, several devices)
        flat = None
    parts: list[tuple[torch.device, list[int], torch.Tensor | None]]
    if flat is not None:
        parts = [(device, list(range(len(tensors))), flat)]
    else:
        by_device: dict[torch.device, list[int]] = {}
        for index, tensor in enumerate(tensors):
            by_device.setdefault(tensor.device, []).append(index)
        parts = [(where, indices, None) for where, indices in by_device.items()]
    groups, graphed = [], False
    for device, indices, values in parts:
        if capturing(device):
            graphed = True
            if accumulating:
                raise FxdebugError(
                    "fxdebug.accumulate_stats cannot run inside a CUDA graph: a replay runs no "
                    "Python, so it cannot count its runs or merge them. Capture the graph from a "
                    "module without accumulate_stats (records(gm) after each replay holds that "
                    "replay's statistics), or run the accumulating module eagerly.")
        if values is None:
            chosen = [tensors[i] for i in indices]
            rows = batch_summaries(chosen, tuple(sizes[i] for i in indices))
        else:
            rows = batch_summaries(tensors, tuple(sizes), values)
        groups.append((indices, rows))
    return groups, stale, graphed, None if flat is None else flat.shape[1:]


class PendingBatch:
    """Stats mode's small captures of one run, in capture order, until their statistics are
    computed together (:meth:`finish`); then each capture's Record (:meth:`record`).

    Capture ``i`` is ``tensors[i]`` (the tensor itself, or a copy where a later in-place op
    of the graph writes it; kept only until :meth:`finish`), its version counter
    ``versions[i]``, its dtype ``dtypes[i]`` and its element count ``sizes[i]`` (parallel
    lists: one append each per capture, nothing to unpack when they are summarized).

    >>> batch = PendingBatch()
    >>> batch.add(torch.tensor([1.0, 3.0]), 0, torch.float32, 2)
    False
    >>> batch.finish()
    False
    >>> batch.record("y", "relu", 0).stats.mean, batch.tensors
    (2.0, [])
    """

    __slots__ = ("tensors", "versions", "dtypes", "sizes", "numel", "queued", "_holder",
                 "_rows", "_shapes", "_trailing", "_stale")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.sizes: list[int] = []
        self.numel = 0
        self.queued = False  # gradients: finish() is queued for the end of the backward pass
        self._holder: list[torch.Tensor | None] = [None]  # the K x 8 rows, on one device
        self._rows: list[torch.Tensor] | None = None  # each capture's row: several devices
        self._shapes: list | None = None  # each tensor's shape, or from _trailing and _sizes
        self._trailing: tuple = ()
        self._stale: frozenset[int] = frozenset()

    def add(self, tensor: torch.Tensor, version: int, dtype: torch.dtype, numel: int) -> bool:
        """Keep ``tensor`` (small, plain, with its ``version`` counter, ``dtype`` and ``numel``
        values) until :meth:`finish`; whether more than ``MAX_PENDING_NUMEL`` values wait."""
        self.tensors.append(tensor)
        self.versions.append(version)
        self.dtypes.append(dtype)
        self.sizes.append(numel)
        self.numel += numel
        return self.numel > MAX_PENDING_NUMEL

    def finish(self, accumulating: bool = False) -> bool:
        """Compute every pending summary and let the tensors go; whether a CUDA graph captured it."""
        tensors = self.tensors
        if not tensors:
            return False
        self.tensors = []
        groups, stale, graphed, trailing = finish_pending(tensors, self.versions, self.dtypes,
                                                          self.sizes, accumulating)
        inner = math.prod(trailing) if trailing is not None else 0
        if trailing is not None and inner:  # each shape is (size // inner, *trailing): made
            self._trailing = (inner, tuple(trailing))  # when its record is read
        else:
            self._shapes = [tensor.shape for tensor in tensors]
        self._stale = frozenset(stale)
        if len(groups) == 1:
            self._holder[0] = groups[0][1]  # each record reads its row when first asked
        else:
            rows: list = [None] * len(tensors)
            for indices, summaries in groups:
                for index, row in zip(indices, summaries.unbind(0)):
                    rows[index] = row
            self._rows = rows
        return graphed

    def record(self, key: str, op: str, index: int) -> Record:
        """The Record of capture ``index`` (after :meth:`finish`)."""
        if self._shapes is None:
            inner, trailing = self._trailing
            shape = torch.Size((self.sizes[index] // inner, *trailing))
        else:
            shape = self._shapes[index]
        dtype = self.dtypes[index]
        if index in self._stale:
            return StaleStatsRecord(key, op, shape, dtype, None, False)
        if self._rows is not None:
            return Record(key, op, shape, dtype, None, False, summary=self._rows[index])
        record = _new_record(BatchedStatsRecord)  # as Record(...), without its __init__: faster
        record.__dict__ = {"key": key, "op": op, "shape": shape, "dtype": dtype, "value": None,
                           "copied": False, "_batch": self._holder, "_row": index}
        return record


def merge_runs(records: dict[str, Record], merge: list[tuple[Record, Record]]) -> None:
    """Accumulating statistics (``fxdebug.accumulate_stats``): each ``(new, earlier)`` Record
    of one key, in capture order, becomes one whose summary is both runs' (``records``, by
    key, updated in place); where either is stale the key stays stale.

    >>> earlier = Record("y", "relu", (2,), torch.float32, None, False,
    ...                  summary=summarize(torch.tensor([1.0, 3.0])))
    >>> new = Record("y", "relu", (2,), torch.float32, None, False,
    ...              summary=summarize(torch.tensor([5.0, 7.0])))
    >>> records = {"y": new}; merge_runs(records, [(new, earlier)]); records["y"].stats.mean
    4.0
    """
    merging: list[tuple[Record, Record, torch.Tensor, torch.Tensor]] = []
    for new, earlier in merge:
        now, then = new.summary, earlier.summary
        if earlier.stale or new.stale:
            if records.get(new.key) is new:
                fields = {f.name: getattr(new, f.name) for f in dataclasses.fields(Record)}
                fields["summary"] = None
                records[new.key] = StaleStatsRecord(**fields)
        elif now is not None and then is not None:
            merging.append((new, earlier, now, then))
    if not merging:
        return
    device = merging[0][2].device
    keys = [new.key for new, *_ in merging]
    if len(set(keys)) == len(keys) and all(now.device == device for _, _, now, _ in merging):
        merged = combine(torch.stack([then.to(device) for *_, then in merging]),
                         torch.stack([now for _, _, now, _ in merging]))
        for (new, *_), row in zip(merging, merged.unbind(0)):
            new.summary, new._stats = row, None
        return
    for new, earlier, _, _ in merging:  # one key captured twice in a run: in order
        now, then = new.summary, earlier.summary  # (then: merged above where a key repeats)
        if now is not None and then is not None:
            new.summary, new._stats = combine(then, now), None
