"""Stats mode's small captures, kept pending during a forward and summarized together at its end.

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
      └─ batch_summaries (fxdebug.stats.batch)    CPU: the tensors of each size as the rows
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

import torch

from ..errors import FxdebugError
from .record import BatchedStatsRecord, Record, StaleStatsRecord, _new_record
from ..stats.batch import (BATCH_DTYPES, CPU_BATCH_NUMEL, batch_summaries, batchable,
                           capture_summary, capturing, summarize_small)
from ..stats.summary import combine
from ..base import torch_compat

__all__ = ["batch_summaries", "batchable", "capturing", "capture_summary", "finish_pending",
           "summarize_small", "merge_runs", "PendingBatch", "SMALL", "READY", "MAX_PENDING_NUMEL",
           "BATCH_DTYPES", "CPU_BATCH_NUMEL"]

MAX_PENDING_NUMEL = 1 << 21
"""Values kept pending at most: past it the pending summaries are computed at once."""


SMALL = "small capture, summary pending"
"""The kind of a Records.pending entry ``(key, op, PendingBatch, SMALL, index)``."""
READY = "capture summarized at once"
"""The kind of a Records.pending entry ``(key, op, Record, READY, None)``."""


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

    >>> from fxdebug.stats.summary import summarize
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
