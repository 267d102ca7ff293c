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
      ├─ the previous logged step's update      param now - its copy, ratio to the param
      └─ logged step: Step.summaries            out, grad of each key; param, param_grad of
           │                                    modules with parameters; copies for the update
           ├─ reduce_summaries (distributed/)   under torch.distributed: the global batch's
           ├─ one read to the host
           └─ SeriesFolder.write, emit          folder (this rank's and the global lines),
                                                TensorBoard writer, callback
    mon.remove() / with monitor(...) as mon:    the model's forward put back; files closed
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from ..distributed.rank_group import RankGroup, distributed_ready, unwrap
from ..distributed.summaries import reduce_summaries
from ..errors import FxdebugError
from ..instrument import instrument, records
from ..runtime.stats_moments import combine_moments, summarize_moments
from ..runtime.torch_compat import run_eagerly_from_compiled_code, skip_frame
from .compiled_copy import CompiledCopy, compiled_model, runs_compiled, summary_of
from .folder import SeriesFolder
from .selection import module_of_key, own_parameters, selected_modules
from .sinks import check_stats, check_writer, emit
from .statistics import slot

__all__ = ["Monitor", "monitor"]

_MISSING = object()


def monitor(model: torch.nn.Module, every: int = 100, folder: str | os.PathLike | None = None,
            writer=None, select=None, start: int = 0, end: int | None = None,
            callback: Callable | None = None, stats=None, group=None) -> "Monitor":
    """Record every selected module's statistics every ``every`` steps of training.

    Train ``mon.model`` (the model itself) as usual and call ``mon.step(loss)`` once per
    step, after ``loss.backward()`` and before ``optimizer.step()``. Steps count from 0;
    step ``s`` is logged when ``start <= s < end`` and ``(s - start) % every == 0``. On a
    logged step the forward runs through an instrumented copy of the model (same
    parameters, same outputs), and for each selected key it records the statistics
    (:data:`~fxdebug.monitor.statistics.STATS`) of the forward output (``out``), its
    gradient (``grad``), and, for modules with parameters, of the parameters (``param``),
    their gradients (``param_grad``) and the change the optimizer makes (``update``,
    measured at the next ``step()``, with ``ratio`` = update rms / parameter rms).
    Off-steps run the model's own forward: nothing is captured or read.

    Args:
        model: the module to train (a DistributedDataParallel: the module inside it; a
            ``torch.compile`` module: off-steps run its compiled forward, logged steps a copy
            compiled the same way whose statistics are graph ops, see docs/monitor.md).
        every: log one step in ``every``.
        folder: write the statistics there (:mod:`fxdebug.monitor.folder`; read them back
            with :func:`fxdebug.load_series`).
        writer: a ``torch.utils.tensorboard.SummaryWriter``: one scalar per
            ``<key>.<kind>.<stat>``.
        select: module-name patterns and module classes (:mod:`fxdebug.monitor.selection`);
            None: every module.
        start / end: the steps logged lie in ``[start, end)`` (``end=None``: no end).
        callback: ``fn(step, {"<key>.<kind>.<stat>": value})`` on every logged step.
        stats: the stats sent to ``writer`` and ``callback`` (default: all).
        group: under ``torch.distributed``, the process group whose ranks' batches make the
            global batch (default: every rank); every rank must call ``step()``.

    Example::

        >>> import torch, fxdebug
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> seen = []  # (step, values): the step's statistics, then (next step) its update
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
                   end=end, callback=callback, stats=stats, group=group)


class Monitor:
    """A monitor attached to a model (see :func:`monitor`); ``remove()`` detaches it."""

    def __init__(self, model: torch.nn.Module, every: int = 100, folder=None, writer=None,
                 select=None, start: int = 0, end: int | None = None,
                 callback: Callable | None = None, stats=None, group=None) -> None:
        _check_steps(every, start, end)
        check_writer(writer)
        if callback is not None and not callable(callback):
            raise FxdebugError(f"fxdebug.monitor: callback= must be callable (fn(step, values)), "
                               f"got {type(callback).__name__}.")
        self.model = model
        inner = compiled_model(model)  # torch.compile(model): the module inside
        self.every, self.start, self.end = every, start, end
        self.steps = 0  # the step the next forward belongs to
        self.notes: list[str] = []
        self._stats = check_stats(stats)
        self._writer, self._callback = writer, callback
        target, _ = unwrap(model if inner is None else inner)
        self._target = target
        chosen = selected_modules(target, select)
        self._modules = {name: None for name, _ in chosen}
        self._parameters = [(name, params) for name, module in chosen
                            if (params := own_parameters(module))]
        self._ranks = _ranks(group)
        # compiled: a copy whose statistics are graph ops (compiled_copy.py); else, or until a
        # logged forward runs under torch.compile, the eager instrumented copy
        self._compiled: CompiledCopy | None = None if inner is None else CompiledCopy(target, model)
        self._copy: torch.nn.Module | None = (
            instrument(target, capture="modules", grads=True) if inner is None else None)
        self._folder = None if folder is None else SeriesFolder(
            folder, rank=self._ranks.rank if self._ranks else 0,
            world=self._ranks.size if self._ranks else 1,
            config={"every": every, "start": start, "end": end,
                    "loss": None if "loss" in self._modules else "loss"},
            first=self._ranks is None or self._ranks.slot == 0)
        self._runs: list = []  # Records of this logged step's forwards, not yet summarized
        self._folded: dict[str, torch.Tensor] = {}  # name -> moment summary, forwards merged
        self._pending_update: tuple | None = None  # (step, copies, param rows) of a logged step
        self._logging = self._logged(0)
        # the forward replaced: the compiled module's (off-steps call its compiled forward as it
        # is), or the model's own
        hooked = self._hooked = target if inner is None else model
        self._own_forward = hooked.__dict__.get("forward", _MISSING)
        plain = hooked.forward
        self._plain = plain

        @functools.wraps(plain)
        def forward(*args, **kwargs):
            if not self._logging or not torch.is_grad_enabled():
                return plain(*args, **kwargs)
            return self._logged_forward(args, kwargs)

        # mon.model compiled later: dynamo runs this frame eagerly and compiles the frame it
        # calls (the model's forward, or the logged copy's)
        hooked.forward = skip_frame(forward)
        self._attached = True

    # -- steps -------------------------------------------------------------------------------

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
            for key in rec.keys():
                if module_of_key(key, self._modules) is None:
                    continue
                self._add(slot(key, "out"), _value(rec, key, self.notes))
                if grads is not None and key in grads:
                    self._add(slot(key, "grad"), _value(grads, key, self.notes))

    def _add(self, name: str, value) -> None:
        summary = summary_of(value)  # a tensor's, or the compiled copy's ready summary
        if summary is None:
            return
        found = self._folded.get(name)
        self._folded[name] = summary if found is None else combine_moments(found, summary)

    def step(self, loss: torch.Tensor | None = None) -> None:
        """End the current step: call it after ``backward()``, before ``optimizer.step()``.

        On a logged step the statistics are computed, reduced over the ranks and written;
        the step before's update is measured whatever the step. Returns None.
        """
        if not self._attached:
            raise FxdebugError("fxdebug.monitor: step() after remove(); the monitor is "
                               "detached. Make a new one with fxdebug.monitor(model, ...).")
        step = self.steps
        if self._pending_update is not None:
            self._record_update()
        if self._logging:
            self._record_step(step, loss)
        self.steps = step + 1
        self._logging = self._logged(self.steps)

    def _record_step(self, step: int, loss) -> None:
        names: list[str] = []
        rows: list[torch.Tensor] = []
        pooled: list[bool] = []
        error: BaseException | None = None
        copies: list[tuple[str, list[torch.Tensor]]] = []
        try:
            self._fold()
            folded, self._folded = self._folded, {}
            for name, summary in folded.items():
                names.append(name)
                rows.append(summary)
                pooled.append(True)  # activations: each rank holds its part of the batch
            for key, own in self._parameters:
                names.append(slot(key, "param"))
                rows.append(_pooled_summary([p.detach() for p in own]))
                pooled.append(_sharded(own))
                grads = [p.grad.detach() for p in own if p.grad is not None]
                if grads:
                    names.append(slot(key, "param_grad"))
                    rows.append(_pooled_summary(grads))
                    pooled.append(_sharded(own))
                copies.append((key, [p.detach().clone() for p in own]))
            if isinstance(loss, torch.Tensor) and "loss" not in self._modules:
                names.append(slot("loss", "out"))
                rows.append(summarize_moments(loss.detach()))
                pooled.append(True)
        except Exception as exc:  # under torch.distributed the others meet this in the reduce
            if self._ranks is None:
                raise
            error = exc
        local = _stack(rows) if error is None else None
        glob = local
        if self._ranks is not None:
            glob = reduce_summaries(self._ranks, names, local, pooled, error)
        local_rows = _read(names, local)
        global_rows = _read(names, glob) if glob is not local else local_rows
        params = {key: global_rows[slot(key, "param")] for key, _ in copies}
        self._pending_update = (step, copies, params)
        self._write(step, local_rows, global_rows, params)

    def _record_update(self) -> None:
        pending, self._pending_update = self._pending_update, None
        if pending is None:
            return
        step, copies, params = pending
        names = [slot(key, "update") for key, _ in copies]
        by_key = dict(self._parameters)
        rows = [_pooled_summary([p.detach() - before for p, before in zip(by_key[key], kept)])
                for key, kept in copies]
        pooled = [_sharded(by_key[key]) for key, _ in copies]
        local = _stack(rows)
        glob = local
        if self._ranks is not None and any(pooled):
            glob = reduce_summaries(self._ranks, names, local, pooled)
        local_rows = _read(names, local)
        global_rows = _read(names, glob) if glob is not local else local_rows
        self._write(step, local_rows, global_rows, params)

    def _write(self, step: int, local_rows: dict, global_rows: dict, params: dict) -> None:
        if self._folder is not None:
            self._folder.write(step, local_rows, global_rows)
        emit(self._callback, self._writer, step, global_rows, params, self._stats)

    # -- detaching ---------------------------------------------------------------------------

    def remove(self) -> None:
        """Detach: the model's own forward back, the folder's files closed, nothing kept.

        Safe to call twice. The folder keeps what was written.
        """
        if not getattr(self, "_attached", False):
            return
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
        self._logging = False

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "attached" if self._attached else "removed"
        window = f"[{self.start}, {'end' if self.end is None else self.end})"
        return (f"<Monitor {type(self._target).__name__}, {len(self._modules)} modules, every "
                f"{self.every} in {window}, step {self.steps}, {state}>")


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


def _value(rec, key: str, notes: list[str]):
    try:
        return rec[key]
    except FxdebugError as exc:  # a view written in place after its capture: not shown
        note = f"{key}: not recorded ({type(exc).__name__})"
        if note not in notes:
            notes.append(note)
        return None


def _sharded(params) -> bool:
    """Whether the parameters are pieces of a larger tensor (FSDP2, tensor parallel): their
    statistics are pooled over the ranks; plain (replicated) ones are every rank's alike."""
    return any(hasattr(p, "placements") and not all(pl.is_replicate() for pl in p.placements)
               for p in params)


def _pooled_summary(tensors: list[torch.Tensor]) -> torch.Tensor:
    summary = summarize_moments(tensors[0])
    for tensor in tensors[1:]:
        summary = combine_moments(summary, summarize_moments(tensor))
    return summary


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    if not rows:
        return torch.zeros(0, 10, dtype=torch.float64)
    device = rows[0].device
    return torch.stack([row.to(device) for row in rows])


def _read(names: list[str], rows: torch.Tensor | None) -> dict[str, list[float]]:
    """The one host read of a step's rows."""
    if rows is None or not names:
        return {}
    return dict(zip(names, rows.tolist()))


# mon.model compiled after the monitor attached: dynamo runs the monitor's bookkeeping eagerly and
# compiles only the forward it calls (the model's, or the logged copy's)
skip_frame(Monitor._logged_forward)
run_eagerly_from_compiled_code(Monitor._begin_logged)
run_eagerly_from_compiled_code(Monitor._end_logged)
