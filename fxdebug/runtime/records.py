"""Records: what one forward of an instrumented module captured, in execution order.

>>> import torch, fxdebug
>>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
>>> _ = gm(torch.ones(1, 3))
>>> rec = fxdebug.records(gm)
>>> rec.keys()
['0', '1']
>>> rec["1"].shape
torch.Size([1, 2])
"""

from __future__ import annotations

import difflib
import threading
import weakref
from typing import Any, Iterator

import torch

from ..errors import FxdebugError, StaleCaptureError
from ..base.fit_to_width import fit_table, table_width
from ..base.formatting import dtype_text, shape_text
from .placement import (dtensor_placement, full_value, grad_layouts, local_value,
                        parameter_pieces, planned_placement)
from .record import Record, _new_record, _version_of
from ..base.records_html import records_table_html
from ..base import torch_compat
from ..base.report import Report
from ..stats.summary import Stats, combine, stats_from_summaries, tensor_stats
from .stats_batch import (READY, SMALL, PendingBatch, batchable, capture_summary,
                          merge_runs)
from .values import flatten_tensors
from ..base.torch_compat import read_version

__all__ = ["Records", "Record", "Stats", "tensor_stats", "SummaryCache", "reused_summary"]

_GRAD_LOCK = threading.Lock()

SummaryCache = dict[int, tuple[weakref.ref, "int | None", torch.Tensor]]
"""Summaries taken this run, by tensor identity (a weak reference), with the version counter."""


# Columns of Records.table a narrow terminal gives up first, and short header names.
RECORD_DROP = ("zeros %", "dtype", "std", "op", "min", "max", "grad non-finite", "mean")
RECORD_SHORT = {"placement": "place", "non-finite": "nonfin", "grad non-finite": "g nonfin", "grad norm": "g norm",
                "zeros %": "0 %"}
PLACEMENT_NOTE = ("placement: S(d)@mesh dim = sharded along dim d (statistics are this rank's "
                  "piece; shape too, unless a DTensor), R = replicated, P = a pending sum, local? = a local tensor "
                  "whose placement is unknown; rec.full(key) assembles the full value (every "
                  "rank calls it)")


class Records(Report):
    """Ordered store of captured values, indexable by key.

    ``rec[key]`` is the captured tensor (tensor mode) or its :class:`Stats`
    (stats mode). Nested outputs are flattened with ``/``: a module returning
    ``(a, {"b": c})`` under key ``blk`` gives ``blk/0`` and ``blk/1/b``.

    Also a :class:`~fxdebug.base.report.Report` without a verdict: ``str`` is
    :meth:`table`, ``repr`` one line (``<Records 75 tensors, 2.7 MiB>``),
    ``to_dict()`` every record's key, op, shape, dtype and statistics.
    """

    def __init__(self, grads_recorded: bool | None = None, *, _of: "Records | None" = None) -> None:
        self._settled: dict[str, Record] = {}  # read through _records, which settles first
        # captures taken this run that no reader asked for yet, made into Records on the first
        # read (_settle), in capture order: (key, op, kept tensor, copied, version) from
        # add_tensor (and the capture node, inlined); (key, op, batch, SMALL, index) from
        # add_stats (index: the capture's place in the PendingBatch `batch`); (key, op, Record,
        # READY, None) from add_stats, for a summary taken at once
        self.pending: list[tuple] = []
        self.notes: list[str] = []
        self._grads: Records | None = None
        self._parameters: list[tuple[str, torch.nn.Parameter]] = []
        # whether the run records gradients (None: unknown); _of: the Records these are the grads of
        self._grads_recorded = grads_recorded
        self._of = _of
        # Summaries taken this run, by tensor identity: a container module's output is
        # usually its last child's, and its statistics are not computed twice.
        self._summaries: SummaryCache = {}
        # stats mode: the small captures whose summaries are computed together (flush_stats);
        # _graphed: filled by a CUDA graph replay
        self._small = PendingBatch()
        self._graphed = False
        self.runs = 1
        self.accumulating = False
        # file:line of each key's code (set by fxdebug.records(gm), kept by saved runs)
        self.locations: dict[str, str] = {}
        self.step = None  # what fxdebug.set_step tagged the run with
        # tensor parallelism: key -> its module's output layout, or why none is known (see
        # fxdebug.runtime.placement.plan_layouts); None for a model without it
        self.layouts: dict[str, Any] | None = None

    # whether add() is Records.add (add_tensor builds its Record directly only then)
    _plain_add = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._plain_add = cls.add is Records.add

    @property
    def _records(self) -> dict[str, Record]:
        """Every Record, by key, in capture order."""
        if self.pending:
            self._settle()
        return self._settled

    @_records.setter
    def _records(self, records: dict[str, Record]) -> None:
        self._settled, self.pending = records, []

    def _settle(self) -> None:
        """Make the pending captures into Records (the same add() makes), in order."""
        if self._small.tensors:
            self.flush_stats()
        pending = self.pending
        count = len(pending)  # (a capture another thread appends meanwhile stays pending)
        records = self._settled
        merge = []
        for key, op, kept, kind, extra in pending[:count]:
            if kind is SMALL:
                record = kept.record(key, op, extra)
            elif kind is READY:
                record = kept
            else:  # add_tensor's (key, op, kept, copied, version)
                record = _new_record(Record)  # add()'s fields; the others keep their defaults
                record.key, record.op, record.shape, record.dtype = \
                    key, op, tuple(kept.shape), kept.dtype
                record.value, record.copied, record.version = kept, kind, extra
            old = records.pop(key, None)  # captured again in this run: it moves to the end
            records[key] = record
            if old is not None and self.accumulating and kind in (SMALL, READY):
                merge.append((record, old))
        del pending[:count]
        if merge:
            merge_runs(records, merge)

    def __getstate__(self):
        if self.pending:
            self._settle()
        state = dict(self.__dict__)
        state["pending"] = []  # (a copy never shares it)
        state["_summaries"] = {}  # weak references: this run's reuse cache, not data
        state["_small"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update({"_graphed": False, **state, "_small": PendingBatch()})

    def start_run(self) -> None:
        """Accumulating statistics: the next run's summaries merge into these (see ``add``)."""
        if self.pending:
            self._settle()
        self._summaries.clear()
        self.runs += 1
        if self._grads is not None:
            self._grads.start_run()

    @property
    def grads(self) -> "Records":
        """Gradients of the captured activations, keyed like the captures, in backward order.

        Filled during ``backward()`` by the gradient-hook nodes of
        ``instrument(..., grads=True)``; ``rec.grads[key]`` is a tensor (or
        :class:`Stats` in stats mode).
        """
        if self._grads is None:
            self._grads = Records(self._grads_recorded, _of=self)
            self._grads.layouts = grad_layouts(self.layouts)  # tensor parallelism
        return self._grads

    def bind_parameters(self, named_parameters) -> None:
        """Remember the module's parameters so the table can show their gradients."""
        self._parameters = list(named_parameters)

    def parameter_grads(self) -> list[tuple[str, tuple[int, ...], Stats | None]]:
        """``(name, shape, Stats of .grad or None)`` for every parameter, in module order; a
        DTensor gradient (FSDP2, tensor parallelism): its local piece's shape and statistics."""
        return [(name, shape, stats) for name, shape, stats, _ in self.parameter_grad_pieces()]

    def parameter_grad_pieces(self) -> list:
        """:meth:`parameter_grads`, each with its gradient's ``(placement or None, summary)``
        (what a saved run keeps to assemble a sharded gradient's statistics)."""
        return parameter_pieces(self._parameters)

    # -- writing (called by fxdebug.runtime) -------------------------------------------
    def add(self, key: str, op: str, value: Any, *, clone: bool = False,
            stats_only: bool = False, via: str = "graph", reuse: bool = True) -> None:
        """File ``value`` (nested tensors) under ``key``: a view, a copy or statistics.

        ``reuse=False`` never reuses a summary taken this run of the same
        tensor object: compiled code may write a buffer without bumping its
        version counter.
        """
        tensors = flatten_tensors(value, key, self.notes)
        layouts = self.layouts
        for name, tensor in tensors:
            placement = None
            if type(tensor) is not torch.Tensor:  # a subclass: a DTensor knows its placement
                placement = dtensor_placement(tensor)
            if placement is None and layouts is not None:  # a plain tensor of a TP model
                placement = planned_placement(layouts.get(key) if name == key else None, tensor)
            if stats_only:
                local = tensor if placement is None else local_value(tensor)
                summary = self._summary(local) if reuse else capture_summary(local)
                old = self._records.get(name) if self.accumulating else None
                if old is not None and old.summary is not None:
                    summary = combine(old.summary, summary)
                record = Record(name, op, tuple(tensor.shape), tensor.dtype, None, False,
                                summary=summary, via=via, placement=placement)
            else:
                kept = tensor.detach().clone() if clone else tensor.detach()
                record = Record(name, op, tuple(tensor.shape), tensor.dtype, kept, clone,
                                version=None if clone else _version_of(tensor), via=via,
                                placement=placement)
            self._records.pop(name, None)
            self._records[name] = record

    def add_stats(self, key: str, op: str, tensor: torch.Tensor, clone: bool = False) -> None:
        """Stats mode's capture of one tensor (``capture_stats``): a small one's summary waits
        for :meth:`flush_stats`, with its tensor's version counter (a copy where ``clone``, set
        where a later in-place op of the graph writes it); others are summarized at once.
        Runs once per capture: kept to a few attribute reads.

        >>> rec = Records(); rec.add_stats("y", "relu", torch.tensor([1.0, 3.0])); rec["y"].mean
        2.0
        """
        if self.layouts is not None or type(tensor) is not torch.Tensor or not self._plain_add:
            self.add(key, op, tensor, stats_only=True)
            return
        if not batchable(tensor):  # summarized at once
            record = Record(key, op, tuple(tensor.shape), tensor.dtype, None, False,
                            summary=self._summary(tensor))
            self.pending.append((key, op, record, READY, None))
            return
        try:
            version = None if clone else read_version(tensor)
        except (RuntimeError, AttributeError):  # an inference tensor has no version counter
            version = None
        if version is None:  # a copy: nothing else writes to it
            tensor = tensor.detach().clone()
            version = _version_of(tensor)
        batch = self._small
        self.pending.append((key, op, batch, SMALL, len(batch.tensors)))
        if batch.add(tensor, version, tensor.dtype, tensor.numel()):  # type: ignore[arg-type]  # (a copy has one)
            self.flush_stats()

    def add_grad_stats(self, key: str, op: str, grad: torch.Tensor) -> None:
        """Stats mode's gradient hook (``grads=True``): :meth:`add_stats`, the small summaries
        taken together when the backward pass ends (at once where no backward pass runs), of
        copies (a backward function may write its incoming gradient in place).

        >>> rec = Records(); rec.add_grad_stats("y", "relu", torch.tensor([1.0, 3.0]))
        >>> rec["y"].mean
        2.0
        """
        with _GRAD_LOCK:  # a backward over several devices runs their hooks on one thread each
            self.add_stats(key, op, grad, clone=True)
            batch = self._small
            if batch.tensors and not batch.queued:
                batch.queued = True
                if not torch_compat.at_backward_end(self._flush_at_backward_end):
                    self.flush_stats()

    def _flush_at_backward_end(self) -> None:
        with _GRAD_LOCK:
            self.flush_stats()

    def flush_stats(self) -> None:
        """Compute every pending summary together (:mod:`.stats_batch`); a capture whose tensor
        was written in place since becomes a :class:`StaleStatsRecord`."""
        batch = self._small
        if not batch.tensors:
            return
        self._small = PendingBatch()
        if batch.finish(self.accumulating):
            self._graphed = True

    def add_tensor(self, key: str, op: str, tensor: torch.Tensor, clone: bool = False) -> None:
        """``add(key, op, tensor, clone=clone)`` for the value a capture node hands over most
        often: one plain ``torch.Tensor`` of a model without tensor parallelism. The same
        Record, without ``add``'s walk of nested values and placements (it goes to ``add``
        for anything else, and where a subclass of Records overrides ``add``). It keeps the
        view (or copy) and the version counter now and makes the Record on the first read:
        a forward whose Records nobody reads builds none.

        >>> rec = Records(); t = torch.ones(2)
        >>> rec.add_tensor("y", "relu", t); torch.equal(rec["y"], t), rec.record("y").copied
        (True, False)
        """
        if type(tensor) is not torch.Tensor or self.layouts is not None or not self._plain_add:
            self.add(key, op, tensor, clone=clone)
            return
        if clone:
            self.pending.append((key, op, tensor.detach().clone(), True, None))
            return
        try:
            version = read_version(tensor)
        except (RuntimeError, AttributeError):  # an inference tensor has no version counter
            version = None
        # a tensor outside autograd (a gradient, most often) is kept itself: a detached view
        # would cost a new tensor, and holding the gradient keeps autograd from handing it on
        # as a parameter's .grad, which clipping and accumulation then write in place
        self.pending.append((key, op, tensor.detach() if tensor.requires_grad else tensor,
                             False, version))

    def _summary(self, tensor: torch.Tensor) -> torch.Tensor:
        """``summarize(tensor)``, reused when this very tensor, unchanged, was summarized this run."""
        return reused_summary(self._summaries, tensor, capture_summary)

    def _read_stats(self) -> None:
        """Read every pending summary at once (one host read per device), after the run."""
        self.flush_stats()
        if self._graphed:  # a CUDA graph replay rewrote the summaries: read them again
            for record in self._records.values():
                if record.summary is not None:
                    record._stats = None
        pending = [(r, r.summary) for r in self._records.values()
                   if r._stats is None and r.summary is not None]
        read = stats_from_summaries([summary for _, summary in pending])
        for (record, _), stats in zip(pending, read):
            record._stats = stats

    # -- reading -----------------------------------------------------------------------
    def __getitem__(self, key: str):
        if not isinstance(key, str):
            raise TypeError(_key_type_message(key))
        record = self.record(key)
        if record.stale:
            now = "?" if record.value is None else _version_of(record.value)
            moved = f"version {record.version} -> {now}"
            if self._of is not None:
                raise StaleCaptureError(
                    f"the gradient recorded under {key!r} ({record.op}) is stale: a backward "
                    f"function wrote it in place after it reached this activation ({moved}), "
                    f"as custom autograd Functions and fused kernels that reuse their incoming "
                    f"gradient do. It no longer shows that gradient. Instrument with "
                    f"mode='stats' (gradient statistics are taken from copies), or read "
                    f"fxdebug.records(gm).grads in a hook before that backward function runs.",
                    key=key)
            raise StaleCaptureError(
                f"the capture of {key!r} ({record.op}) is stale: its tensor was written in place "
                f"after it was captured ({moved}), "
                f"by code outside the traced graph (a forward hook, code that runs after the "
                f"forward, a write fxdebug cannot see). It no longer shows what the model "
                f"computed. Read fxdebug.records(gm) before that write, or make the module that "
                f"writes a leaf module (fxdebug.trace(model, leaf_modules=[...])): captures of "
                f"what a leaf module receives are copies.", key=key)
        return record.stats if record.value is None else record.value

    def full(self, key: str) -> torch.Tensor:
        """The full value of the capture under ``key``, however it is sharded: a collective
        every rank of its mesh calls (a shard is gathered, a pending sum ``Partial`` reduced).
        A capture no mesh shards is returned as it is; a local tensor whose placement is
        unknown raises, saying why.

        >>> import torch, fxdebug
        >>> gm = fxdebug.instrument(torch.nn.Linear(2, 1))
        >>> _ = gm(torch.ones(1, 2))
        >>> torch.equal(fxdebug.records(gm).full("output"), fxdebug.records(gm)["output"])
        True
        """
        record = self.record(key)
        value = self[key]
        if not isinstance(value, torch.Tensor):
            raise FxdebugError(f"records.full({key!r}): the capture holds statistics only "
                               f"(mode='stats'); instrument with mode='tensor' to assemble it.")
        section = "grads" if self._of is not None else "records"
        mesh_ranks = getattr(self, "mesh_ranks", {}).get((section, key))  # a run read back
        return full_value(key, value, record.placement, mesh_ranks)

    def record(self, key: str) -> Record:
        """The :class:`Record` (value, shape, dtype, stats) stored under ``key``."""
        if not isinstance(key, str):
            raise TypeError(_key_type_message(key))
        self.flush_stats()
        try:
            record = self._records[key]
        except KeyError:
            raise KeyError(self._missing(key)) from None
        if self._graphed and record.summary is not None:
            record._stats = None  # a CUDA graph replay rewrote it: read it again
        return record

    def _missing(self, key: str) -> str:
        if self._of is not None and not self._records:
            if self._grads_recorded is False:
                return (f"no gradient recorded under {key!r}: this module records no gradients. "
                        f"Instrument it with fxdebug.instrument(model, grads=True), run forward "
                        f"and backward, then read rec.grads[key].")
            captured = f" ({len(self._of)} activations were captured)" if len(self._of) else ""
            return (f"no gradient recorded under {key!r}: no backward has run through the latest "
                    f"forward{captured}. Call backward() on its output (or torch.autograd.grad), "
                    f"then read rec.grads[key].")
        if not self._records and self.notes:
            return f"no value captured under {key!r}: {' '.join(self.notes)}"
        if not self._records:
            return (f"no value captured under {key!r}: nothing was captured yet. Run the "
                    f"instrumented module once, then call fxdebug.records(gm) again.")
        close = difflib.get_close_matches(key, list(self._records), n=3, cutoff=0.5)
        hint = f" Close keys: {', '.join(map(repr, close))}." if close else ""
        return (f"no value captured under {key!r}.{hint} rec.keys() lists the "
                f"{len(self._records)} captured keys.")

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def keys(self) -> list[str]:
        """Captured keys in execution order."""
        return list(self._records)

    def items(self) -> list[tuple[str, Any]]:
        return [(key, self[key]) for key in self._records]

    def records(self) -> list[Record]:
        """All :class:`Record` objects in execution order."""
        self.flush_stats()
        if self._graphed:
            self._read_stats()
        return list(self._records.values())

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held (views of live activations and copies)."""
        return sum(record.nbytes for record in self._records.values())

    def table(self, wide: bool | None = None, floatfmt: str = ".4g") -> str:
        """A table of every capture: key, op, shape, dtype, statistics, then totals.

        In a terminal (or with ``COLUMNS`` set) the table fits its width: the
        least important columns are dropped and long keys end in ``…``;
        ``wide=True`` always gives every column (see :mod:`fxdebug.base.fit_to_width`).

        With recorded gradients it adds ``grad norm`` and ``grad non-finite``
        columns and a table of parameter gradients (name, shape, grad norm).
        Byte-identical for identical inputs and weights, in any process.
        """
        grads = self._grads if self._grads is not None and len(self._grads) else None
        self._read_stats()
        if grads is not None:
            grads._read_stats()
        rows = []
        stale = []
        placed = any(r.placement is not None for r in self._records.values())
        for record in self._records.values():
            if record.stale:
                stale.append(record.key)
                row = [record.key, record.op, shape_text(record.shape),
                       dtype_text(record.dtype), *["stale"] * 6]
            else:
                stats = record.stats
                row = [record.key, record.op, shape_text(record.shape),
                       dtype_text(record.dtype),
                       *(format(value, floatfmt) for value in stats[:4]),
                       format(stats.zeros_pct, ".1f"), str(stats.nonfinite)]
            if placed:  # after dtype: "S(1)@tp", "R", "P@tp", "local?" (see runtime.placement)
                row.insert(4, "" if record.placement is None else record.placement.text)
            if grads is not None:
                grad = grads._records.get(record.key)
                row += (["-", "-"] if grad is None else
                        [format(grad.stats.norm, floatfmt), str(grad.stats.nonfinite)])
            rows.append(row)
        headers = ["key", "op", "shape", "dtype", "mean", "std", "min", "max", "zeros %",
                   "non-finite"]
        if placed:
            headers.insert(4, "placement")
        if grads is not None:
            headers += ["grad norm", "grad non-finite"]
        text = fit_table(rows, headers, width=table_width(wide), drop=RECORD_DROP,
                         truncate=("key", "op"), short=RECORD_SHORT,
                         colalign=("left",) * (4 + placed) + ("right",) * (len(headers) - 4 - placed))
        copied = sum(r.nbytes for r in self._records.values() if r.copied)
        lines = [text, f"{len(self._records)} tensors captured, {_human_bytes(self.nbytes)} held "
                       f"({_human_bytes(copied)} in copies)"]
        if grads is not None:
            held = grads.nbytes
            lines.append(f"{len(grads)} gradients recorded, {_human_bytes(held)} held")
            bad = [r.key for r in grads._records.values() if r.stats.nonfinite]
            if bad:
                lines.append(f"first non-finite gradient in backward order: {bad[0]}")
        parameters = [(name, shape, stats) for name, shape, stats in self.parameter_grads()
                      if stats is not None]
        if parameters:
            lines.append("")
            lines.append(fit_table(
                [[name, shape_text(shape), format(stats.norm, floatfmt), str(stats.nonfinite)]
                 for name, shape, stats in parameters],
                ["parameter", "shape", "grad norm", "grad non-finite"], width=table_width(wide),
                truncate=("parameter",), short=RECORD_SHORT,
                colalign=("left", "left", "right", "right")))
        lines.extend(f"note: {note}" for note in self.notes)
        if placed:
            lines.append(PLACEMENT_NOTE)
        if stale:
            lines.append(f"stale (written in place after capture, not shown): {', '.join(stale)}")
        return "\n".join(lines)

    def _size(self) -> str:
        return f"{len(self._records)} tensors, {_human_bytes(self.nbytes)}"

    def _finding(self) -> str:
        self._read_stats()
        bad = next((r.key for r in self._records.values()
                    if not r.stale and r.stats.nonfinite), None)
        return "" if bad is None else f"first non-finite capture {bad}"

    def _fields(self) -> dict[str, Any]:
        self._read_stats()
        records = {}
        for record in self._records.values():
            entry: dict[str, Any] = {"op": record.op, "shape": list(record.shape),
                                     "dtype": str(record.dtype).replace("torch.", "")}
            if record.placement is not None:
                entry["placement"] = record.placement.text
            if record.stale:
                entry["stale"] = True
            else:
                entry["stats"] = record.stats._asdict()
            records[record.key] = entry
        return {"records": records, "notes": list(self.notes), "runs": self.runs}

    def _repr_html_(self) -> str:
        """The table as HTML, for Jupyter (non-finite rows marked)."""
        return (f"<div><p>{len(self._records)} tensors captured, "
                f"{_human_bytes(self.nbytes)} held</p>{records_table_html(self)}</div>")


def reused_summary(cache: SummaryCache, tensor: torch.Tensor, summarize) -> torch.Tensor:
    """``summarize(tensor)``, or the summary ``cache`` holds of this very tensor at this very
    version: a container module's output is usually its last child's, summarized once.

    >>> cache: SummaryCache = {}; t = torch.ones(3)
    >>> first = reused_summary(cache, t, torch.sum)
    >>> reused_summary(cache, t, torch.sum) is first  # the same tensor, unchanged: reused
    True
    >>> _ = t.add_(1); reused_summary(cache, t, torch.sum).item()  # written since: summed again
    6.0
    """
    seen = cache.get(id(tensor))
    version = torch_compat.tensor_version(tensor)
    if seen is not None and seen[0]() is tensor and version is not None and seen[1] == version:
        return seen[2]
    summary = summarize(tensor)
    try:
        cache[id(tensor)] = (weakref.ref(tensor), version, summary)
    except TypeError:  # a tensor subclass without weak references: no reuse
        pass
    return summary


def _key_type_message(key) -> str:
    return (f"Records keys are strings, got {type(key).__name__} {key!r}: a node key "
            f"('layer1.0.conv1', 'relu_1') or a nested output 'key/index' ('lstm/0'). "
            f"rec.keys() lists them in execution order; by position: rec[rec.keys()[{key!r}]].")


def _human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"
