"""The Records of the monitor's logged forwards: each large capture summarized as it is made.

A logged step of :func:`fxdebug.monitor` on an eager model runs the instrumented copy
(``instrument(model, capture="modules", grads=True)``). Kept as tensors until ``mon.step()``,
its captures would hold every module's output past the point where autograd lets it go, a copy
of each one a later in-place op writes, and every activation gradient through the whole
backward: memory a plain step reuses, which the logged step would have to take fresh (on the
CPU, some 100 ms of page faults a step for resnet50 at 8x3x128x128; on a GPU, a higher peak).
So a capture of ``AT_ONCE_NUMEL`` values or more is summarized when it is made (its moment
summary, :func:`~fxdebug.stats.moments.summarize_moments`: the values it held then, whatever
writes them later) and let go; the smaller ones are kept and summarized together at the
step's end, where one call for all of them costs less than one each::

    capture node / gradient hook
      └─ MomentRecords.add(key, op, value)
           ├─ a plain tensor >= AT_ONCE_NUMEL values: its summary now (a Record with no value)
           └─ anything else (small, a DTensor, a tensor-parallel value): kept, as Records.add

``rec[key]`` of a summarized capture is a :class:`~fxdebug.monitoring.compiled_copy.Summary`
(what the compiled copy's runs hand over too); the monitor reads both alike.

>>> rec = MomentRecords()
>>> rec.add("big", "linear", torch.ones(AT_ONCE_NUMEL)); rec.add("small", "relu", torch.ones(2))
>>> type(rec["big"]).__name__, rec["big"].summary[:2].tolist(), type(rec["small"]).__name__
('Summary', [131072.0, 1.0], 'Tensor')
"""

from __future__ import annotations

import dataclasses

import torch

from ..runtime.placement import grad_layouts
from ..runtime.records import Record, Records, SummaryCache, reused_summary
from ..runtime.stats_batch import READY
from ..runtime.values import flatten_tensors
from ..stats.moments import summarize_moments
from .compiled_copy import Summary

__all__ = ["MomentRecords", "AT_ONCE_NUMEL"]

AT_ONCE_NUMEL = 1 << 17
"""Values from which a capture is summarized when it is made rather than kept (below, a call
per tensor costs more than its sums, and the kept tensors are small)."""


class MomentRecords(Records):
    """Records whose large plain-tensor captures hold their moment summary, not the tensor."""

    def __init__(self, grads_recorded: bool | None = None, *, _of: Records | None = None) -> None:
        super().__init__(grads_recorded, _of=_of)
        # this run's summaries by tensor identity: a container module's output is usually its
        # last child's, summarized once
        self._moments: SummaryCache = {}

    @property
    def grads(self) -> Records:
        if self._grads is None:
            self._grads = MomentRecords(self._grads_recorded, _of=self)
            self._grads.layouts = grad_layouts(self.layouts)  # tensor parallelism
        return self._grads

    def add(self, key: str, op: str, value, *, clone: bool = False, stats_only: bool = False,
            via: str = "graph", reuse: bool = True) -> None:
        if stats_only or self.layouts is not None:
            super().add(key, op, value, clone=clone, stats_only=stats_only, via=via, reuse=reuse)
            return
        for name, tensor in flatten_tensors(value, key, self.notes):
            if type(tensor) is not torch.Tensor or tensor.numel() < AT_ONCE_NUMEL:
                super().add(name, op, tensor, clone=clone, via=via, reuse=reuse)
                continue
            moments = self._moments_of(tensor, reuse)
            record = _MomentRecord(name, op, tuple(tensor.shape), tensor.dtype, None, False,
                                   summary=moments[:8], via=via, moments=moments)
            self.pending.append((name, op, record, READY, None))

    def _moments_of(self, tensor: torch.Tensor, reuse: bool) -> torch.Tensor:
        if not reuse:
            return summarize_moments(tensor)
        return reused_summary(self._moments, tensor, summarize_moments)

    def __getstate__(self):
        state = super().__getstate__()
        state["_moments"] = {}  # weak references: this run's reuse cache, not data
        return state

    def __getitem__(self, key: str):
        record = self.record(key)
        if isinstance(record, _MomentRecord):
            return Summary(record.moments)
        return super().__getitem__(key)


@dataclasses.dataclass(repr=False)
class _MomentRecord(Record):
    """A capture summarized when it was made: ``moments`` its ten numbers, ``summary`` the
    first eight (what :attr:`Record.stats` reads)."""

    moments: torch.Tensor = dataclasses.field(default_factory=lambda: torch.full((10,), float("nan")))
