"""``fxdebug.monitor``: statistics of every selected module over training steps.

Call tree::

    mon = monitor(model, every=N, ...)
      ├─ selected_modules(model, select)        the modules watched (selection.py)
      ├─ instrument(model, grads=True)          a copy sharing the parameters, whose graph
      │                                         captures every module output (views) and
      │                                         hooks its gradient: the captures are exact
      └─ model.forward = the monitor's          on the model itself (mon.model is model)
    model(x)                                    every step
      ├─ off-step: the model's own forward      nothing else: no capture, no host read
      └─ logged step: the instrumented copy     Records kept until the step (micro-batches:
                                                each folded in at the next forward)
    loss.backward()                             logged step: the gradient hooks keep views
    mon.step(loss)                              every step, before optimizer.step()
      ├─ the previous logged step's update      param now - its copy: summarized on the
      │                                         device and kept (no read, no collective)
      └─ logged step: _record_step              out, grad of each key; param, param_grad of
           │                                    modules with parameters, each parameter
           │                                    copied for the update as it is read, into
           │                                    buffers kept (update_copies.py)
           ├─ RankLayout (pooling.py)           per row, this rank's share of the global one
           ├─ _publish: reduce_summaries        under torch.distributed: the global batch's,
           │    (distributed/)                  with the kept update's rows in the same reduce
           ├─ one read to the host
           └─ SeriesFolder.write, emit          folder (this rank's and the global lines),
                                                TensorBoard writer, callback: the update's
                                                step first, then this step
    mon.remove() / with monitor(...) as mon:    the kept update published (every rank); the
                                                model's forward put back; files closed
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Callable, NamedTuple, Sequence

import torch

from ..distributed.rank_group import RankGroup, distributed_ready, unwrap
from ..distributed.summaries import NO_GROUP, empty_summaries, reduce_summaries
from ..errors import FidelityWarning, FxdebugError
from ..instrumenting import instrument, records
from ..runtime import RECORDER_ATTR, Recorder
from ..stats.moments import combine_moments, pool_moments, summarize_many, summarize_moments
from ..base.torch_compat import run_eagerly_from_compiled_code, skip_frame
from .compiled_copy import CompiledCopy, compiled_model, runs_compiled, summary_of
from .folder import SeriesFolder
from .moment_records import MomentRecords
from .pooling import RankLayout, Share
from .selection import module_of_key, own_parameters, selected_modules
from .sinks import check_stats, check_writer, emit
from .spike_report import SpikeReport
from .spike_watch import SpikeWatch
from .spikes import check_rules
from .statistics import slot, split_slot
from .update_copies import UpdateCopies

__all__ = ["Monitor", "monitor"]

_MISSING = object()


def monitor(model: torch.nn.Module, every: int = 100, folder: str | os.PathLike | None = None,
            writer=None, select=None, start: int = 0, end: int | None = None,
            callback: Callable | None = None, stats=None, group=None, spikes=None) -> "Monitor":
    """Record every selected module's statistics every ``every`` steps of training.

    Train ``mon.model`` (the model itself) as usual and call ``mon.step(loss)`` once per
    step, after ``loss.backward()`` and before ``optimizer.step()``. Steps count from 0;
    step ``s`` is logged when ``start <= s < end`` and ``(s - start) % every == 0``. On a
    logged step the forward runs through an instrumented copy of the model (same
    parameters, same outputs), and for each selected key it records the statistics
    (:data:`~fxdebug.monitoring.statistics.STATS`) of the forward output (``out``), its
    gradient (``grad``), and, for modules with parameters, of the parameters (``param``),
    their gradients (``param_grad``) and the change the optimizer makes (``update``,
    measured at the next ``step()``, with ``ratio`` = update rms / parameter rms).
    Off-steps run the model's own forward: nothing is captured or read.

    Args:
        model: the module to train (a DistributedDataParallel: the module inside it; a
            ``torch.compile`` module: off-steps run its compiled forward, logged steps a copy
            compiled the same way whose statistics are graph ops, see docs/monitor.md).
        every: log one step in ``every``.
        folder: write the statistics there (:mod:`fxdebug.monitoring.folder`; read them back
            with :func:`fxdebug.load_series`).
        writer: a ``torch.utils.tensorboard.SummaryWriter``: one scalar per
            ``<key>.<kind>.<stat>``.
        select: module-name patterns and module classes (:mod:`fxdebug.monitoring.selection`);
            None: every module.
        start / end: the steps logged lie in ``[start, end)`` (``end=None``: no end).
        callback: ``fn(step, {"<key>.<kind>.<stat>": value})`` on every logged step.
        stats: the stats sent to ``writer`` and ``callback`` (default: all).
        group: under ``torch.distributed``, the process group whose ranks' batches make the
            global batch (default: every rank); every rank must call ``step()``.
        spikes: rules that make ``step()`` replay the step and return a
            :class:`~fxdebug.monitoring.spike_report.SpikeReport` (:mod:`fxdebug.monitoring.spikes`:
            ``True`` a non-finite loss or gradient, 10x the loss's window max, 6 sigma of the
            gradient norm; or a list of ``NonFinite()``, ``Factor(metric, x)``,
            ``Sigma(metric, k)``). None: no check, nothing kept between forward and step.

    Example::

        >>> import torch, fxdebug
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> seen = []  # (step, values): step 0's, its update (read at step 2), step 2's, its update
        >>> with fxdebug.monitor(net, every=2, callback=lambda *call: seen.append(call)) as mon:
        ...     for step in range(4):
        ...         loss = mon.model(torch.randn(8, 4)).sum()
        ...         loss.backward()
        ...         mon.step(loss)
        ...         opt.step(); opt.zero_grad()
        >>> [step for step, _ in seen], "0.out.rms" in seen[0][1], "0.update.ratio" in seen[1][1]
        ([0, 0, 2, 2], True, True)
    """
    return Monitor(model, every=every, folder=folder, writer=writer, select=select, start=start,
                   end=end, callback=callback, stats=stats, group=group, spikes=spikes)


class Monitor:
    """A monitor attached to a model (see :func:`monitor`); ``remove()`` detaches it."""

    # the updates measured on the device since the last logged step (read with the next one's
    # rows, or at remove()), and an error met measuring them (raised on every rank there)
    _measured: tuple = ()
    _update_error: BaseException | None = None

    def __init__(self, model: torch.nn.Module, every: int = 100, folder=None, writer=None,
                 select=None, start: int = 0, end: int | None = None,
                 callback: Callable | None = None, stats=None, group=None,
                 spikes=None) -> None:
        _check_steps(every, start, end)
        check_writer(writer)
        if callback is not None and not callable(callback):
            raise FxdebugError(f"fxdebug.monitor: callback= must be callable (fn(step, values)), "
                               f"got {type(callback).__name__}.")
        self.model = model
        inner = compiled_model(model)  # torch.compile(model): the module inside
        self.every, self.start, self.end = every, start, end
        self._steps = 0  # the step the next forward belongs to
        self.notes: list[str] = []
        self.spikes: list[SpikeReport] = []  # every spike report step() returned
        self._stats = check_stats(stats)
        self._writer, self._callback = writer, callback
        target, wrapper = unwrap(model if inner is None else inner)
        self._target = target
        chosen = selected_modules(target, select)
        self._modules = {name: None for name, _ in chosen}
        self._parameters = [(name, params) for name, module in chosen
                            if (params := own_parameters(module))]
        self._ranks = _ranks(group)
        rules = check_rules(spikes)
        # compiled: a copy whose statistics are graph ops (compiled_copy.py); else, or until a
        # logged forward runs under torch.compile, the eager instrumented copy
        self._compiled: CompiledCopy | None = None if inner is None else CompiledCopy(target, model)
        self._copy: torch.nn.Module | None = (
            _logged_copy(target) if inner is None else None)
        self._folder = None if folder is None else SeriesFolder(
            folder, rank=self._ranks.rank if self._ranks else 0,
            world=self._ranks.size if self._ranks else 1,
            config={"every": every, "start": start, "end": end,
                    "loss": None if "loss" in self._modules else "loss"},
            first=self._ranks is None or self._ranks.slot == 0)
        self._runs: list = []  # Records of this logged step's forwards, not yet summarized
        self._folded: dict[str, tuple] = {}  # name -> (moment summary, Share), forwards merged
        self._pending_update: tuple | None = None  # (step, copies, param rows) of a logged step
        self._copies = UpdateCopies()  # the copies' buffers, kept between logged steps
        self._logging = self._logged(0)
        # the forward replaced: the compiled module's (off-steps call its compiled forward as it
        # is), or the model's own
        hooked = self._hooked = target if inner is None else model
        self._own_forward = hooked.__dict__.get("forward", _MISSING)
        if inner is None and self._own_forward is not _MISSING:
            _warn_instance_forward(target, self._own_forward)
        plain = hooked.forward
        self._plain = plain

        @functools.wraps(plain)
        def forward(*args, **kwargs):
            spikes = self._spikes
            if not torch.is_grad_enabled() or (not self._logging and spikes is None):
                return plain(*args, **kwargs)
            entry = None if spikes is None else spikes.begin(args, kwargs)
            out = self._logged_forward(args, kwargs) if self._logging else plain(*args, **kwargs)
            if entry is not None:
                spikes.end(entry, out)
            return out

        # mon.model compiled later: dynamo runs this frame eagerly and compiles the frame it
        # calls (the model's forward, or the logged copy's)
        hooked.forward = skip_frame(forward)
        self._attached = True
        self._spikes = None if not rules else SpikeWatch(
            target, rules, self._ranks, self._unpatched,
            averaged=wrapper == "DistributedDataParallel",
            loss_key=None if "loss" in self._modules else "loss")

    # -- steps -------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """The step the next forward belongs to: 0 at attach, one more at each ``step()``.

        Set it before a step's first forward to count on from elsewhere (a resumed run's
        step): the steps logged and written follow it.
        """
        return self._steps

    @steps.setter
    def steps(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise FxdebugError(f"fxdebug.monitor: steps must be an int >= 0, got {step!r}.")
        self._steps = step
        self._logging = self._attached and self._logged(step)

    @property
    def logged(self) -> bool:
        """Whether the step in progress (``steps``) is one the monitor records."""
        return self._logging

    def _logged(self, step: int) -> bool:
        return step >= self.start and (self.end is None or step < self.end) \
            and (step - self.start) % self.every == 0

    def _logged_forward(self, args, kwargs):
        # (asked here: dynamo's callback is unset in the frames it runs eagerly with their callees)
        call = self._begin_logged(args, kwargs, runs_compiled())
        out = call(*args, **kwargs)  # compiled where the model is (or by the call around it)
        self._end_logged()
        return out

    def _begin_logged(self, args, kwargs, under_compile: bool):
        """The copy to call for this logged forward (dynamo never traces this bookkeeping)."""
        self._fold()  # the previous micro-batch's backward is done: summarize it, let it go
        compiled = self._compiled
        if compiled is None and under_compile:  # mon.model compiled after attaching
            compiled = self._compiled = CompiledCopy(self._target)
        copy = compiled if compiled is not None else self._copy
        if copy is None:  # pragma: no cover - one of the two is always made
            raise FxdebugError("fxdebug.monitor: no logged copy of the model; make a new monitor.")
        if copy.training != self._target.training:
            copy.train(self._target.training)
        return copy if compiled is None else compiled.begin(args, kwargs)

    def _end_logged(self) -> None:
        compiled, copy = self._compiled, self._copy
        if compiled is not None:
            self._runs.append(compiled.end())
        elif copy is not None:
            self._runs.append(records(copy))

    def _fold(self) -> None:
        runs, self._runs = self._runs, []
        for rec in runs:
            grads = rec.grads if rec.keys() else None
            values: list[tuple[str, object, object]] = []  # (name, value, placement)
            for key in rec.keys():
                if module_of_key(key, self._modules) is None:
                    continue
                values.append((slot(key, "out"), *_value(rec, key, self.notes)))
                if grads is not None and key in grads:
                    values.append((slot(key, "grad"), *_value(grads, key, self.notes)))
            tensors = [value for _, value, _ in values if isinstance(value, torch.Tensor)]
            summaries = iter(summarize_many(tensors))  # one call of the C kernel on the CPU
            for name, value, placement in values:
                summary = next(summaries) if isinstance(value, torch.Tensor) \
                    else summary_of(value)  # the compiled copy's ready summary, or None
                if summary is not None:
                    self._add(name, summary, value, placement)

    def _add(self, name: str, summary: torch.Tensor, value, placement=None) -> None:
        found = self._folded.get(name)
        if found is None:
            self._folded[name] = (summary, self._layout.activation(value, placement))
        else:
            self._folded[name] = (combine_moments(found[0], summary), found[1])

    @functools.cached_property
    def _layout(self) -> RankLayout:
        """Which of this rank's pieces count in the global summaries (host facts only)."""
        return RankLayout.of(self._target, self._ranks)

    def step(self, loss: torch.Tensor | None = None) -> SpikeReport | None:
        """End the current step: call it after ``backward()``, before ``optimizer.step()``.

        On a logged step the statistics are computed, reduced over the ranks and written;
        the step before's update is measured whatever the step. Returns None, or with
        ``spikes=`` a :class:`~fxdebug.monitoring.spike_report.SpikeReport` when a rule fired
        and the step was replayed (also written to the folder's ``spikes.jsonl``).
        """
        if not self._attached:
            raise FxdebugError("fxdebug.monitor: step() after remove(); the monitor is "
                               "detached. Make a new one with fxdebug.monitor(model, ...).")
        step = self.steps
        if self._pending_update is not None:
            self._record_update()
        logged = self._logging
        if logged:
            self._record_step(step, loss)
        report = None
        if self._spikes is not None:
            try:
                report = self._spikes.check(step, loss, logged)
            finally:
                self.steps = step + 1
            if report is not None:
                self.spikes.append(report)
                if self._folder is not None:
                    self._folder.write_spike(report.record())
            return report
        self.steps = step + 1
        return None

    def _record_step(self, step: int, loss) -> None:
        entries, self._measured = list(self._measured), ()  # updates measured since the last
        error, self._update_error = self._update_error, None
        copies: list[tuple[str, list[torch.Tensor]]] = []
        try:
            self._fold()
            folded, self._folded = self._folded, {}
            for name, (summary, share) in folded.items():
                entries.append(_activation_row(step, name, summary, share))
            parameters = self._parameters
            kept = self._copies.buffers([p for _, own in parameters for p in own])
            entries += self._parameter_rows(step, "param", [
                (key, [p.detach() for p in own]) for key, own in parameters],
                copy_to=self._copies.targets())
            buffers = iter(kept)
            copies = [(key, [next(buffers) for _ in own]) for key, own in parameters]
            entries += self._parameter_rows(step, "param_grad", [
                (key, [p.grad.detach() for p in own if p.grad is not None])
                for key, own in parameters])
            if isinstance(loss, torch.Tensor) and "loss" not in self._modules:
                loss = loss.detach()
                entries.append(_activation_row(step, slot("loss", "out"), summarize_moments(loss),
                                               self._layout.activation(loss)))
        except Exception as exc:  # under torch.distributed the others meet this in the reduce
            if self._ranks is None:
                raise
            error = error or exc
        shown = self._publish(entries, error)
        self._pending_update = (step, copies, {key: shown.get((step, slot(key, "param")))
                                                for key, _ in copies})

    def _record_update(self) -> None:
        """The update of the last logged step, measured on the device and kept: it is reduced
        and read with the next logged step's rows (or at remove()), never here."""
        pending, self._pending_update = self._pending_update, None
        if pending is None:
            return
        step, copies, params = pending
        by_key = dict(self._parameters)
        try:
            now = [(key, [p.detach() for p in by_key[key]]) for key, _ in copies]
            self._measured = self._measured + tuple(self._parameter_rows(
                step, "update", now, params, minus=[b for _, kept in copies for b in kept]))
        except Exception as exc:  # the others would wait for this rank at the next reduce
            if self._ranks is None:
                raise
            self._update_error = exc

    def _parameter_rows(self, step: int, kind: str, tensors: list[tuple[str, list[torch.Tensor]]],
                        params: dict | None = None, minus: list[torch.Tensor] | None = None,
                        copy_to: list[torch.Tensor | None] | None = None) -> list["_Row"]:
        """Each module's parameters (their gradients, their updates) pooled, every module in one
        go: this rank's own summary, and its share of the global one (the pieces no other rank
        holds too). A module without such tensors (no gradient yet) has no row. ``minus`` and
        ``copy_to``: as :func:`~fxdebug.stats.moments.summarize_many`'s, a tensor per piece
        (every module then has pieces)."""
        tensors = [(key, pieces) for key, pieces in tensors if pieces]
        flat = [t for _, pieces in tensors for t in pieces]
        if not flat:
            return []
        lengths = [len(pieces) for _, pieces in tensors]
        summaries = _stack(summarize_many(flat, minus=minus, copy_to=copy_to))
        own = pool_moments(summaries, lengths)
        shares = [self._layout.parameter(t) for t in flat]
        sent = own
        if not all(share.counts for share in shares):
            counts = torch.tensor([share.counts for share in shares], device=summaries.device)
            empty = empty_summaries(1, summaries.device)
            sent = pool_moments(torch.where(counts[:, None], summaries, empty), lengths)
        rows, begin = [], 0
        for (key, _), length, mine, shared in zip(tensors, lengths, own, sent):
            left_out = next((s.left_out for s in shares[begin:begin + length] if s.left_out), "")
            begin += length
            rows.append(_Row(step, slot(key, kind), mine, shared, NO_GROUP, left_out,
                             None if params is None else params.get(key)))
        return rows

    def _publish(self, entries: list["_Row"], error: BaseException | None = None) -> dict:
        """Reduce, read (once) and write the rows of one or more steps (a logged step's, and
        the update measured since the one before): ``{(step, name): global row}``."""
        if self._ranks is None:
            if error is not None:
                raise error
            shown = entries
            local = _stack([e.own for e in entries])
            rows = _read(local, local)
        else:
            shown = [e for e in entries if not e.left_out]
            for e in entries:
                if e.left_out:
                    _note(self.notes, f"{split_slot(e.name)[0]}: {split_slot(e.name)[1]} left "
                                      f"out of the global series: {e.left_out}")
            sent = None if error is not None else _stack([e.sent for e in shown])
            glob = reduce_summaries(self._ranks, [f"{e.step}:{e.name}" for e in shown], sent,
                                    [e.group for e in shown], error)  # raises if one failed
            rows = _read(_stack([e.own for e in entries]), glob)
        own_rows, global_rows = rows[:len(entries)], rows[len(entries):]
        found = {(e.step, e.name): row for e, row in zip(shown, global_rows)}
        for step in dict.fromkeys(e.step for e in entries):  # the update's step first
            mine: dict[str, Sequence[float]] = {
                e.name: row for e, row in zip(entries, own_rows) if e.step == step}
            shared: dict[str, Sequence[float]] = {
                name: row for (at, name), row in found.items() if at == step}
            params: dict[str, Sequence[float]] = {
                split_slot(e.name)[0]: e.params for e in entries
                if e.step == step and e.params is not None}
            if self._folder is not None:
                self._folder.write(step, mine, shared)
            if self._spikes is not None:
                self._spikes.remember(step, shared, params)
            emit(self._callback, self._writer, step, shared, params, self._stats)
        return found

    @contextlib.contextmanager
    def _unpatched(self):
        """The model with its own forward for a while (to copy or trace it), then the monitor's."""
        target = self._target
        if self._hooked is not target:  # a compiled module holds the patch; the model has none
            yield target
            return
        patched = target.__dict__.get("forward", _MISSING)
        if self._own_forward is _MISSING:
            target.__dict__.pop("forward", None)
        else:
            target.forward = self._own_forward
        try:
            yield target
        finally:
            if patched is _MISSING:
                target.__dict__.pop("forward", None)
            else:
                target.forward = patched

    # -- detaching ---------------------------------------------------------------------------

    def remove(self) -> None:
        """Detach: the model's own forward back, the folder's files closed, nothing kept.

        The update measured since the last logged step is reduced and written first (under
        ``torch.distributed`` a collective: every rank calls ``remove()``). Safe to call
        twice. The folder keeps what was written.
        """
        self._detach(flush=True)

    def _detach(self, flush: bool) -> None:
        if not getattr(self, "_attached", False):
            return
        measured, error = self._measured, self._update_error
        self._measured, self._update_error = (), None
        try:
            if flush and (measured or error is not None):
                self._publish(list(measured), error)
        finally:
            self._detach_now()

    def _detach_now(self) -> None:
        self._attached = False
        hooked = self._hooked
        if self._own_forward is _MISSING:
            hooked.__dict__.pop("forward", None)
        else:
            hooked.forward = self._own_forward
        if self._folder is not None:
            self._folder.close()
        self._runs, self._folded, self._pending_update = [], {}, None
        self._copy = self._compiled = None
        self._copies.release()
        self._spikes = None
        self._logging = False

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc_info) -> None:
        # leaving on an error: no collective (another rank may not be leaving)
        self._detach(flush=exc_info[0] is None)

    def __repr__(self) -> str:
        state = "attached" if self._attached else "removed"
        window = f"[{self.start}, {'end' if self.end is None else self.end})"
        return (f"<Monitor {type(self._target).__name__}, {len(self._modules)} modules, every "
                f"{self.every} in {window}, step {self.steps}, {state}>")


def _warn_instance_forward(target: torch.nn.Module, own) -> None:
    """Logged steps run a traced copy of the class's forward: say so where the instance's
    forward is another function (an autocast wrapper would not apply on logged steps)."""
    what = getattr(own, "__qualname__", type(own).__name__)
    warnings.warn(
        f"fxdebug.monitor: {type(target).__name__}'s forward is replaced on the instance "
        f"({what}); logged steps run a traced copy of {type(target).__name__}.forward without "
        f"that replacement (an autocast or output-casting wrapper does not apply to them). "
        f"Attach the monitor before wrapping forward, or put the wrapper's effect in the "
        f"model (e.g. torch.autocast around the training step).", FidelityWarning, stacklevel=4)


def _logged_copy(target: torch.nn.Module) -> torch.nn.Module:
    """The eager copy a logged forward runs: every selected module's output and gradient
    captured, the large ones summarized as they are made (:mod:`.moment_records`)."""
    copy = instrument(target, capture="modules", grads=True)
    recorder = getattr(copy, RECORDER_ATTR, None)
    if isinstance(recorder, Recorder):
        recorder.records_type = MomentRecords
    return copy


def _check_steps(every, start, end) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise FxdebugError(f"fxdebug.monitor: every= must be a positive int (log one step in "
                           f"every), got {every!r}.")
    if not isinstance(start, int) or start < 0:
        raise FxdebugError(f"fxdebug.monitor: start= must be an int >= 0, got {start!r}.")
    if end is not None and (not isinstance(end, int) or end <= start):
        raise FxdebugError(f"fxdebug.monitor: end= must be None or an int above start={start}, "
                           f"got {end!r}.")


def _ranks(group) -> RankGroup | None:
    """The group to reduce over; None in a single process (or a world of one)."""
    if group is None and not distributed_ready():
        return None
    ranks = RankGroup.of(group, what="fxdebug.monitor", where="group=")
    return ranks if ranks.size > 1 else None


class _Row(NamedTuple):
    """One summary of one step: this rank's own, its share of the global one (``sent``),
    its replica group, why it is left out of the global series (if it is), and for an
    update the parameters' global row of its step (for ``ratio``)."""

    step: int
    name: str
    own: torch.Tensor
    sent: torch.Tensor
    group: int
    left_out: str
    params: list | None = None


def _activation_row(step: int, name: str, summary: torch.Tensor, share: Share) -> _Row:
    sent = summary if share.counts else empty_summaries(1, summary.device)[0]
    return _Row(step, name, summary, sent, share.group, share.left_out)


def _note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _value(rec, key: str, notes: list[str]) -> tuple:
    """``(value, placement)`` of a capture (``(None, None)`` where it is not shown)."""
    try:
        record = getattr(rec, "record", None)  # the compiled copy's summaries have no Record
        return rec[key], None if record is None else record(key).placement
    except FxdebugError as exc:  # a view written in place after its capture: not shown
        _note(notes, f"{key}: not recorded ({type(exc).__name__})")
        return None, None


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    if not rows:
        return torch.zeros(0, 10, dtype=torch.float64)
    device = rows[0].device
    return torch.stack([row.to(device) for row in rows])


def _read(own: torch.Tensor, shared: torch.Tensor) -> list[list[float]]:
    """The one host read of a step's rows: this rank's, then the global ones."""
    if shared is own:
        rows = own.tolist()
        return rows + rows
    return torch.cat([own, shared.to(own.device)]).tolist()


# mon.model compiled after the monitor attached: dynamo runs the monitor's bookkeeping eagerly and
# compiles only the forward it calls (the model's, or the logged copy's)
skip_frame(Monitor._logged_forward)
run_eagerly_from_compiled_code(Monitor._begin_logged)
run_eagerly_from_compiled_code(Monitor._end_logged)
