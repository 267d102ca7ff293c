"""Stats mode inside ``torch.compile``: statistics as graph ops, handed out once per graph.

While dynamo traces ``capture_stats`` (:func:`.compiled_ops.compiled_capture`),
each tensor's summary (the eight float64 numbers of :mod:`fxdebug.stats.summary`) is written
as plain torch ops on the value, which inductor compiles into its kernels,
and nothing runs in Python per capture::

    torch.compile(fxdebug.instrument(model, mode="stats"))(x)
      dynamo traces gm.forward:
      ├─ begin_run                        fxdebug::begin_run op; sink.pending = ()
      ├─ capture_stats(recorder, v, ...)  per tensor t of v: graph_summary(t), then
      │                                   sink.pending += ((key, op, shape, dtype, summary),)
      │                                   (on the CPU the shape a tensor: compiled_ops._shape)
      │                                   (a value graph ops cannot summarize: today's
      │                                    fxdebug::capture op, and a place in the order)
      └─ end of the graph (or a graph break): dynamo stores sink.pending once, its
         summaries being outputs of the graph (its side-effect replay)
    reading the Records (any access), or the next run's begin_run
      └─ CompiledRecords files one Record per key, in capture order

A float32, float16 or bfloat16 tensor of ``FLOAT32_MIN_NUMEL`` values or
more is summed in float32 (float64 arithmetic halves a CPU's vector width and
costs some 4x as much; eager stats mode's kernel does the same): one pass over
the value, which inductor compiles into a loop of its own kernel, with the
count, min, max and zeros of the finite values, and the sums of their
deviations from a *shift* (the mean of a few values read at fixed places,
less the largest and smallest)
and of the squares, scaled by 1 / those few values' largest magnitude.
No branch, no copy of the value, nothing read back: the ``M2`` it gives is
kept where it is precise (see ``FLOAT32_RATIO``: sums finite, squares at most
16x ``M2``, none lost to underflow) and is NaN elsewhere (values spread so far
from the shift or so wide that float32 cannot hold the squares), never an
imprecise number (the mean too, where its own error bound fails); min, max
and the counts are exact::

    graph_summary(t)
      ├─ float64 t                     _two_pass_scaled
      ├─ float32/16/bf16, large        _float32_summary
      └─ otherwise                     _float64_summary

``_float64_summary`` takes one pass over the finite values: count, min, max
and zeros, and the sums of their deviations from a shift and of the squares,
in float64. The shift is the same trimmed mean of a few values read at fixed
places of the tensor (NaN and Inf count as a deviation of exactly 0), so
``M2 = squares - total**2 / count`` cannot cancel: a shift between the
smallest and the largest value lies at most ``sqrt(M2)`` from the mean, so
the squares are at most ``(count + 1) * M2`` and float64 rounding leaves
``M2`` within ``count * 2**-53`` of itself (a large mean with a small spread,
values near float32's overflow: their squares are finite in float64). Where
no pick is finite the shift is 0; if that leaves ``M2`` imprecise, the std is
NaN, never a wrong number. float64 values take two passes, scaled by their largest
magnitude (as :func:`fxdebug.stats.summary._summarize_masked`) so their squares cannot
overflow. The Records object of a compiled run is a :class:`CompiledRecords`;
it fills itself from the recorder's sink the first time it is read.

>>> s = graph_summary(torch.tensor([1.0, 3.0, float("inf"), 0.0]))
>>> [round(v, 4) for v in s.tolist()]
[3.0, 1.3333, 4.6667, 0.0, 3.0, 1.0, 1.0, 4.0]
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .records import Record, Records
from ..stats.summary import combine

__all__ = ["graph_summary", "scaled_deviations", "summarizable_in_graph", "StatsSink", "CompiledRecords", "SINK_ATTR",
           "file_entries"]

# The attribute of a Recorder that holds its StatsSink.
SINK_ATTR = "fxdebug_stats_sink"
_INF = float("inf")
# NaN is written float("nan") in the graph ops: dynamo folds that call into a constant, where
# it guards a global NaN by a Python check per use (NaN != NaN: its guards are never merged)


def summarizable_in_graph(tensor: Any) -> bool:
    """Whether graph ops can summarize ``tensor`` (a plain, strided, non-empty tensor).

    >>> summarizable_in_graph(torch.ones(2)), summarizable_in_graph(torch.ones(0))
    (True, False)
    """
    return (isinstance(tensor, torch.Tensor) and type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.layout == torch.strided and not tensor.is_quantized
            and tensor.device.type != "meta" and tensor.numel() > 0)


def graph_summary(tensor: torch.Tensor) -> torch.Tensor:
    """The summary of ``tensor`` (see :mod:`fxdebug.stats.summary`) as torch ops, equal to float64's answer.

    >>> [round(v, 4) for v in graph_summary(torch.tensor([2, 0, 4])).tolist()]
    [3.0, 2.0, 8.0, 0.0, 4.0, 1.0, 0.0, 3.0]
    """
    value = tensor.detach()
    if value.is_complex():
        value = value.abs()
    if value.dtype == torch.float64:
        return _two_pass_scaled(value)
    if value.dtype in _NARROW and _always(value.numel() >= FLOAT32_MIN_NUMEL):
        return _float32_summary(value)
    return _float64_summary(value)


def _always(condition: Any) -> bool:
    """Whether ``condition`` on the sizes holds at every size the graph being traced can be
    called with, without a guard (a guard on a size would compile the graph anew each time the
    size crosses it); a Python bool as it is."""
    return statically_known_true(condition)


def _counter(value: torch.Tensor) -> torch.dtype:
    """The dtype that counts ``value``'s elements: int32 (narrower vectors) where it always can."""
    return torch.int32 if _always(value.numel() < 2 ** 31) else torch.int64


FLOAT32_MIN_NUMEL = 1 << 12
"""float32, float16 and bfloat16 tensors from this size on are summed in float32."""

FLOAT32_RATIO = 16.0
"""float32's M2 is kept where the squared deviations from the shift are at most this many times
M2 (as the eager kernel's ``BOUND_RATIO``): rounding then leaves it within some 1e-6 of itself
in practice, a few ``FLOAT32_RATIO * 4096 * 2**-24`` at worst (inductor's CPU sums add at most
4096 values in a row, then pairwise); elsewhere the std is NaN, never an imprecise one."""

_NARROW = (torch.float32, torch.float16, torch.bfloat16)
_SUM_ERROR = 4100 * 2.0 ** -24  # a float32 sum's error per value summed, at worst, in inductor
_TINY = 2.0 ** -126  # float32's smallest normal number


def _float32_summary(value: torch.Tensor) -> torch.Tensor:
    """The summary from float32 sums over the finite values (see the module docstring).

    The deviations from the picks' trimmed mean are scaled by 1 / the picks' largest
    magnitude, so their squares neither overflow nor fall below float32's normal range
    where the picks are like the other values; M2 is NaN where they are not (see
    ``FLOAT32_RATIO``), or where the squares could have lost digits to underflow. Few graph
    nodes: the picks' statistics are scalar ops stored by one tiny reduction, the value's one
    loop in the layout inductor chose for it, the summary one pointwise op (inductor runs each
    scalar node of a kernel between two thread barriers).
    """
    wide = value.float()
    shift, scale = _trimmed_picks(wide)
    finite = _finite(wide)
    deviation = torch.where(finite, (wide - shift) * scale, 0.0)
    total = deviation.sum().double()
    squares = (deviation * deviation).sum().double()
    counter = _counter(value)
    count = finite.sum(dtype=counter).double()
    low = torch.where(finite, wide, _INF).amin().double()
    high = torch.where(finite, wide, -_INF).amax().double()
    zeros = (wide == 0).sum(dtype=counter).double()
    safe = count.clamp(min=1)
    m2 = (squares - total * total / safe).clamp(min=0)
    # finite sums, squares not far above M2, none of them lost to float32's underflow
    precise = (torch.isfinite(total + squares) & (squares <= FLOAT32_RATIO * m2)
               & ((squares >= count * _TINY) | (low == high)))
    unscale = 1.0 / scale.double()
    m2 = torch.where(precise, m2 * unscale * unscale, float("nan"))
    mean = shift.double() + total * unscale / safe
    # the float32 sum of the deviations is off by at most _SUM_ERROR * sqrt(count * squares)
    close = _SUM_ERROR * torch.sqrt(squares / safe) <= 2.0 ** -20 * mean.abs() / unscale
    mean = torch.where((count > 0) & torch.isfinite(total + squares) & (precise | close), mean,
                       float("nan"))
    numel = torch.full_like(count, value.numel())
    return _vector([count, mean, m2, low, high, zeros, numel - count, numel])


def _vector(scalars: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(scalars)`` as one pointwise op (a stack is one small node per scalar)."""
    place = torch.arange(len(scalars), device=scalars[0].device)
    out = scalars[-1].expand(len(scalars))
    for i in reversed(range(len(scalars) - 1)):
        out = torch.where(place == i, scalars[i], out)
    return out


def _trimmed_picks(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The shift (see :func:`_trimmed_shift`) and 1 / the picks' largest finite magnitude (1 if
    none is finite), each stored by one tiny reduction (inductor stores a value's deviations in a
    buffer of their own where the ops that compute them are many; each scalar node it stores is
    one more buffer the compiled code allocates per capture)."""
    shift, reach = _trimmed_shift(value)
    scale = torch.where((reach > 0) & (reach < _INF), 1.0 / reach.clamp(min=_TINY), 1.0)
    # a reduction's result is a stored number: the value's loop loads it rather than computing
    # it anew per value (inductor would store the deviations in a buffer of their own instead)
    stored = torch.stack([shift.float(), scale.float()])[:, None].expand(2, 2).amax(1)
    return stored[0], stored[1]


def _trimmed_shift(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of the finite ones of ``_PICKS`` values spread over ``value``, less the largest
    and the smallest (0 if none is finite), and their largest magnitude (Inf if none is
    finite), in float64: a few vector ops on the picks, whatever the sizes."""
    picks = _picks(value).to(torch.float64)
    finite = _finite(picks)
    count = finite.sum(dtype=torch.float64)
    total = torch.where(finite, picks, 0.0).sum()
    low = torch.where(finite, picks, _INF).amin()
    high = torch.where(finite, picks, -_INF).amax()
    trimmed = torch.where(count > 2, (total - low - high) / (count - 2).clamp(min=1),
                          total / count.clamp(min=1))
    return trimmed, torch.maximum(low.abs(), high.abs())


def _float64_summary(value: torch.Tensor) -> torch.Tensor:
    """The summary from float64 sums over the finite values, one pass (see the module)."""
    if not value.is_floating_point():  # integers, bools: exact in float64, squares finite
        value = value.to(torch.float64)
    finite = torch.isfinite(value)
    shift = _trimmed_shift(value)[0]
    # deviations from the shift in float64, NaN and Inf counting as exactly 0
    deviation = torch.where(finite, value.to(torch.float64) - shift, 0.0)
    counter = _counter(value)
    count = finite.sum(dtype=counter).to(torch.float64)
    safe = count.clamp(min=1)
    total = deviation.sum()
    squares = (deviation * deviation).sum()
    m2 = (squares - total * total / safe).clamp(min=0)
    # a shift within the finite values' range adds at most count * M2 to the squares; only a
    # shift of 0 (every pick not finite) can be far from the values: no std then, never a wrong one
    m2 = torch.where(squares <= _PRECISE_RATIO * m2, m2, float("nan"))
    low = torch.where(finite, value, _INF).amin().to(torch.float64)
    high = torch.where(finite, value, -_INF).amax().to(torch.float64)
    zeros = (value == 0).sum(dtype=counter).to(torch.float64)
    mean = torch.where(count > 0, shift + total / safe, float("nan"))
    numel = torch.full_like(count, value.numel())
    return torch.stack([count, mean, m2, low, high, zeros, numel - count, numel])


# M2 is kept where the squared deviations from the shift are at most this many times M2: float64
# rounding then leaves it within some 1e-7 of itself, whatever the order of the sums.
_PRECISE_RATIO = float(2 ** 30)
_PICKS = 8  # values looked at for the shift, spread over the tensor


def _picks(value: torch.Tensor) -> torch.Tensor:
    """The values at ``_PICKS`` flat (row-major) places spread over ``value``, read by one
    indexing op whose index tensors are computed from the sizes: no reshape, which would force
    inductor to store the value (and whatever computes it) in row-major order rather than the
    layout it chose (channels-last), and no Python integer computed from a size, which would
    make dynamo compile the graph anew for each size."""
    if value.dim() == 0:
        return value.expand(_PICKS)
    place = torch.arange(_PICKS, device=value.device) * value.numel() // _PICKS
    index = []
    for size in reversed(value.shape):
        index.append(place % size)
        place = place // size
    return value[tuple(reversed(index))]


def _finite(value: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` of a floating tensor as one comparison (NaN compares false)."""
    return value.abs() < _INF


def scaled_deviations(value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float64 values: ``(count, count clamped to 1, mean, low, high, scale, deviations)`` of
    the finite ones; the deviations from the mean are scaled by the largest magnitude
    (``scale``) so that their squares cannot overflow, and are 0 where a value is not finite."""
    finite = torch.isfinite(value)
    count = finite.sum().to(torch.float64)
    safe = count.clamp(min=1)
    mean = torch.where(finite, value, 0.0).sum() / safe
    low = torch.where(finite, value, _INF).amin()
    high = torch.where(finite, value, -_INF).amax()
    scale = torch.maximum(low.abs(), high.abs())
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, 1.0)
    deviation = torch.where(finite, (value - mean) * (1.0 / scale), 0.0)
    return count, safe, mean, low, high, scale, deviation


def _two_pass_scaled(value: torch.Tensor) -> torch.Tensor:
    """float64 values: the mean of the finite ones, then their deviations from it, scaled by the
    largest magnitude so their squares cannot overflow."""
    count, safe, mean, low, high, scale, deviation = scaled_deviations(value)
    total = deviation.sum()
    m2 = ((deviation * deviation).sum() - total * total / safe).clamp(min=0) * scale * scale
    zeros = (value == 0).sum().to(torch.float64)
    mean = torch.where(count > 0, mean + total * scale / safe, float("nan"))
    numel = torch.full_like(count, value.numel())
    return torch.stack([count, mean, m2, low, high, zeros, numel - count, numel])


class StatsSink:
    """Where one Recorder's compiled graphs leave their summaries (see the module docstring).

    ``pending``: ``((key, op, shape, dtype, summary or None), ...)`` of the latest
    run, stored by the compiled code; ``records``: the Records of that run;
    ``stale``: the ``pending`` of the run before, already filed; ``taken``: how
    many entries of ``pending`` are filed.
    """

    def __init__(self) -> None:
        self.pending: tuple | None = None
        self.records: CompiledRecords | None = None
        self.stale: tuple | None = None
        self.taken = 0

    def __getstate__(self) -> dict:  # the values of a run belong to that run
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def start(self, records: Records) -> None:
        """A compiled forward starts: hand the previous run's summaries to its Records (filed when
        they are read; at once where the same Records accumulates), then collect for ``records``."""
        previous, pending = self.records, self.pending
        if previous is not None and pending is not None and pending is not self.stale \
                and self.taken < len(pending):
            if previous is records:  # accumulating: this run's summaries merge into the same ones
                self.fill(previous)
            else:
                previous.__dict__["_fxdebug_rest"] = pending[self.taken:]
        if previous is not None and previous is not records:
            previous.__dict__["_fxdebug_sink"] = None
        self.stale, self.taken = pending, 0
        if type(records) is Records:  # (a saved run's StreamingRecords never gets here)
            records.__class__ = CompiledRecords
        if isinstance(records, CompiledRecords):
            records.__dict__["_fxdebug_sink"] = self
            self.records = records
        else:
            self.records = None

    def fill(self, records: "CompiledRecords") -> None:
        """File the summaries the compiled code left since the last fill into ``records``."""
        pending = self.pending
        if records is not self.records or pending is None or pending is self.stale \
                or self.taken >= len(pending):
            return
        file_entries(records, pending[self.taken:])
        self.taken = len(pending)


def file_entries(records: Records, entries: tuple) -> None:
    """One Record per ``(key, op, shape, dtype, summary)``, in order; a summary of None is a
    capture the fxdebug::capture op filed already: it only takes its place in the order."""
    store = Records._records.fget(records)  # type: ignore[attr-defined]  # (not the sink's fill)
    accumulating = records.accumulating
    for key, op, shape, dtype, summary in entries:
        if summary is None:
            kept = store.pop(key, None)
            if kept is not None:
                store[key] = kept
            continue
        old = store.pop(key, None)
        if accumulating and old is not None and old.summary is not None:
            summary = combine(old.summary, summary)
        shape = tuple(shape.tolist()) if isinstance(shape, torch.Tensor) else tuple(shape)
        store[key] = Record(key, op, shape, dtype, None, False, summary=summary)


class CompiledRecords(Records):
    """The Records of a compiled forward: filled from the recorder's sink when first read.

    >>> import fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), mode="stats")
    >>> _ = torch.compile(gm, backend="aot_eager")(torch.tensor([-1.0, 3.0]))
    >>> rec = fxdebug.records(gm)
    >>> type(rec).__name__, rec["0"].mean, rec["0"].zeros_pct
    ('CompiledRecords', 1.5, 50.0)
    """

    @property
    def _records(self) -> dict[str, Record]:
        state = self.__dict__
        rest = state.pop("_fxdebug_rest", None)
        if rest is not None:  # the summaries of this run, handed over when the next one started
            file_entries(self, rest)
        sink = state.get("_fxdebug_sink")
        if sink is not None and sink.records is self:
            sink.fill(self)
        return Records._records.fget(self)  # type: ignore[attr-defined]

    @_records.setter
    def _records(self, value: dict[str, Record]) -> None:
        Records._records.fset(self, value)  # type: ignore[attr-defined]

    def __getstate__(self):
        self._records  # noqa: B018 - filled before it is copied
        state = super().__getstate__()
        state.pop("_fxdebug_sink", None)
        state.pop("_fxdebug_rest", None)
        return state
