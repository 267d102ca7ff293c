"""Streaming captures to disk: ``instrument(model, folder=path)``.

Each forward is one run, ``path/run-000001``, ``path/run-000002``, ... (numbering
goes on after the runs already there; under torch.distributed with several
ranks, ``path/rank-R/run-...``). A capture is handed to a background thread as
it is made and the forward goes on; the thread writes its bytes (the format of
:mod:`.saved_runs`) and lets it go, so a run holds at most ``limit_bytes`` of
captures not yet written: a forward waits for the writer when more are queued.
The run's ``manifest.json`` is written when the next forward starts, at
:func:`~fxdebug.records` of the module, when :func:`~fxdebug.load_records` of this
process reads that folder (even after the module was deleted), and when the process exits.

A view captured from the model is written after the forward has moved on: its
version counter is checked when it is written, and a tensor written in place
since its capture is saved as stale (never shown), as in memory.

Errors in the thread (a full disk) are raised by the next forward or by
:func:`~fxdebug.records`, naming the run folder. The thread is a daemon, stops at
:func:`~fxdebug.records` (it starts again with the next capture) and is flushed and
stopped at exit.

>>> import os, tempfile, torch, fxdebug
>>> folder = os.path.join(tempfile.mkdtemp(), "runs")
>>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), folder=folder)
>>> _ = gm(torch.tensor([-1.0, 2.0])); _ = gm(torch.tensor([3.0, -4.0]))
>>> _ = fxdebug.records(gm)  # every run written
>>> sorted(os.listdir(folder)), fxdebug.load_records(folder)["0"]
(['run-000001', 'run-000002'], tensor([3., 0.]))
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import weakref

import torch

from ..errors import SavedRunError
from ..runtime.placement import grad_layouts
from ..runtime.records import Record, Records
from .saved_runs import (BEFORE_READING, RunFile, load_records, location_of, manifest_of,
                         record_entry, run_context, run_folders, write_manifest)

__all__ = ["RunWriter", "StreamingRecords", "DEFAULT_LIMIT_BYTES", "flush_writers_of"]

DEFAULT_LIMIT_BYTES = 64 * 2**20
"""Bytes of captures a run may hold before they are written (the forward waits beyond)."""

_WRITERS: "weakref.WeakSet[RunWriter]" = weakref.WeakSet()


class StreamingRecords(Records):
    """The Records of a forward whose captures go to disk: they keep keys, not values.

    ``fxdebug.records(gm)`` flushes the writer and returns the run as read
    back from disk (:class:`~fxdebug.runs.saved_runs.SavedRecords`).
    """

    def __init__(self, writer: "RunWriter", run: int, grads_recorded: bool | None,
                 section: str = "records", _of: Records | None = None) -> None:
        super().__init__(grads_recorded, _of=_of)
        self.writer, self.run, self.section = writer, run, section
        self.written: list[str] = []

    @property
    def grads(self) -> Records:
        if self._grads is None:
            self._grads = StreamingRecords(self.writer, self.run, self._grads_recorded, "grads",
                                           _of=self)
            self._grads.notes = self.notes
            self._grads.layouts = grad_layouts(self.layouts)  # tensor parallelism
        return self._grads

    def add(self, key: str, op: str, value, *, clone: bool = False, stats_only: bool = False,
            via: str = "graph", reuse: bool = True) -> None:
        scratch = Records()
        scratch.notes, scratch._summaries = self.notes, self._summaries
        scratch.layouts = self.layouts  # tensor parallelism: each capture's placement
        Records.add(scratch, key, op, value, clone=clone, stats_only=stats_only, via=via,
                    reuse=reuse)
        for record in scratch.records():
            self.written.append(record.key)
            self.writer.put(self.run, self.section, record)

    def __len__(self) -> int:
        return len(self.written)


class _Run:
    """What the writer thread knows of the run it writes."""

    def __init__(self, number: int, folder: str, context: dict, notes: list) -> None:
        self.number, self.folder, self.context, self.notes = number, folder, context, notes
        self.data = RunFile(folder)
        self.entries: list[dict] = []
        self.grads: list[dict] = []
        self.grads_recorded: bool | None = None
        self.parameters: list = []

    def manifest(self) -> dict:
        context = dict(self.context)
        for entry in self.entries + self.grads:  # device and dtype of the first captures
            if context["device"] is None and entry.get("device"):
                context["device"] = entry["device"]
            if context["dtype"] is None and getattr(torch, entry["dtype"]).is_floating_point:
                context["dtype"] = entry["dtype"]
        self.data.handle.flush()
        return manifest_of(context, self.entries, self.grads, self.data.offset,
                           grads_recorded=self.grads_recorded, parameters=self.parameters,
                           notes=self.notes)


class RunWriter:
    """Writes each forward of an instrumented module to ``path/run-NNNNNN`` (module docstring)."""

    def __init__(self, path: str | os.PathLike, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.path = os.fspath(path)
        self.limit_bytes = int(limit_bytes)
        self.locations: dict[str, str] = {}
        self.folder: str | None = None  # the latest run's folder
        self.run = 0
        self._base: str | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending = 0
        self.peak_bytes = 0  # the most capture bytes queued at once
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._error: tuple[BaseException, str] | None = None
        self._open: _Run | None = None  # the run being written, kept while the thread is stopped
        if not _WRITERS:
            atexit.unregister(_flush_at_exit)  # once, whatever the number of writers
            atexit.register(_flush_at_exit)
        _WRITERS.add(self)

    # -- the forward's side -------------------------------------------------------------
    def start_run(self, grads_recorded: bool | None, notes, step=None) -> StreamingRecords:
        """A new run folder and the Records that stream into it (a forward starts)."""
        self.raise_error()
        base = self._base or self._resolve_base()
        existing = run_folders(base)
        self.run = (existing[-1][0] if existing else 0) + 1
        self.folder = os.path.join(base, f"run-{self.run:06d}")
        try:
            os.makedirs(self.folder)
        except OSError as exc:
            raise SavedRunError(f"cannot create the run folder {self.folder}: {exc}. Choose "
                                f"another folder.") from exc
        context = run_context([], step)
        context["device"] = None
        records = StreamingRecords(self, self.run, grads_recorded)
        records.notes.extend(notes)
        records.step = step
        self._enqueue(("begin", self.run, self.folder, context, records.notes, grads_recorded))
        return records

    def base_folder(self) -> str:
        """The folder the runs go to: ``path``, or under torch.distributed ``path/rank-R``."""
        return self._base or self.path

    def _resolve_base(self) -> str:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and torch.distributed.get_world_size() > 1:
            self._base = os.path.join(self.path, f"rank-{torch.distributed.get_rank()}")
        else:
            self._base = self.path
        return self._base

    def put(self, run: int, section: str, record: Record) -> None:
        """Queue ``record`` for writing; wait while the queue holds ``limit_bytes`` already."""
        if record.value is not None:  # a collective's result (tensor parallelism) completes
            local = record._local(record.value)  # here: its wait belongs to this thread
            wait = getattr(local, "trigger_wait", None)
            if callable(wait):
                wait()
        stream = None
        if record.value is not None and record.value.device.type == "cuda":
            stream = torch.cuda.current_stream(record.value.device)
        nbytes = record.nbytes
        with self._cond:
            while self._pending and self._pending + nbytes > self.limit_bytes \
                    and self._error is None:
                self._cond.wait()
            if self._error is not None:
                return  # dropped: the error is raised by the next forward or flush
            self._pending += nbytes
            self.peak_bytes = max(self.peak_bytes, self._pending)
        self._enqueue(("record", run, section, record, stream, nbytes))

    def set_parameters(self, parameters: list) -> None:
        """Parameter-gradient statistics for the current run's manifest (see ``records(gm)``):
        ``(name, shape, stats, piece)`` (:func:`~fxdebug.runtime.placement.parameter_pieces`)."""
        self._enqueue(("parameters", self.run, parameters))

    def latest_records(self) -> Records:
        """Everything queued written, then the latest run read back from disk (what
        ``records(gm)`` gives for a module instrumented with ``folder=``)."""
        self.flush()
        if self.folder is None:
            raise SavedRunError("this run writer has no folder: nothing was written to read back. "
                                "Instrument with folder=path to stream runs to disk.")
        return load_records(self.folder)

    def flush(self, stop: bool = True) -> None:
        """Write everything queued and the current run's manifest; raise a writer error."""
        if self.folder is not None:
            self._enqueue(("manifest", self.run))
        with self._cond:
            self._wait_written()
            self._stopping = stop
            self._cond.notify_all()
        thread = self._thread
        if stop and thread is not None and thread is not threading.current_thread():
            thread.join()
        self.raise_error()

    def wait_written(self) -> None:
        """Wait until the thread has written everything queued, or failed to; raises nothing
        (the next forward or :meth:`flush` raises a failure)."""
        with self._cond:
            self._wait_written()

    def _wait_written(self) -> None:
        while (self._queue or self._busy) and self._thread is not None and self._thread.is_alive():
            self._cond.wait(0.1)

    def raise_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            exc, folder = error
            raise SavedRunError(f"writing the run {folder} failed: {type(exc).__name__}: {exc}. "
                                f"Captures after the failure were not saved; free disk space or "
                                f"choose another folder.") from exc

    def _enqueue(self, item: tuple) -> None:
        with self._cond:
            self._queue.append(item)
            self._stopping = False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="fxdebug-run-writer",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    # -- the writer thread --------------------------------------------------------------
    def _work(self) -> None:
        run = self._open
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    self._open = run
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                run = self._write(item, run)
            except Exception as exc:  # raised to the user by the next forward or flush
                folder = run.folder if run is not None else self.path
                if run is not None:  # its manifest, if one is written, says what is missing
                    run.notes.append(f"writing failed after {len(run.entries)} capture(s) "
                                     f"({type(exc).__name__}: {exc}); later ones were not saved")
                with self._cond:
                    self._error = (exc, folder)
                    self._pending = 0
                    self._queue.clear()
            finally:
                with self._cond:
                    self._busy = False
                    if item[0] == "record":
                        self._pending = max(0, self._pending - item[-1])
                    self._cond.notify_all()

    def _write(self, item: tuple, run: _Run | None) -> _Run | None:
        kind, number = item[0], item[1]
        if kind == "begin":
            if run is not None:
                self._finish(run)
            _, number, folder, context, notes, grads_recorded = item
            run = _Run(number, folder, context, notes)
            run.grads_recorded = grads_recorded
            return run
        if run is None or run.number != number:
            if kind == "record" and run is not None:
                run.notes.append(f"{item[3].key}: captured by run {number}, arrived after run "
                                 f"{run.number} began; not saved")
            return run
        if kind == "record":
            _, _, section, record, stream, _ = item
            location = location_of(self.locations, record.key)
            if stream is not None:
                with torch.cuda.stream(stream):
                    entry = record_entry(record, location, run.data)
            else:
                entry = record_entry(record, location, run.data)
            (run.entries if section == "records" else run.grads).append(entry)
            if section == "grads":
                run.grads_recorded = True
        elif kind == "parameters":
            run.parameters = item[2]
        elif kind == "manifest":
            write_manifest(run.folder, run.manifest())
        return run

    def _finish(self, run: _Run) -> None:
        write_manifest(run.folder, run.manifest())
        run.data.close()


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def flush_writers_of(path: str) -> None:
    """Finish what this process's writers still hold for ``path`` (an ``instrument(folder=)`` folder, a
    folder above or below it, a run folder): :func:`~fxdebug.load_records` calls it before
    reading, so a run streamed by a module since deleted is read whole. A writer's error
    is raised here, naming its run folder."""
    target = os.path.realpath(path)
    for writer in list(_WRITERS):
        base = os.path.realpath(writer.base_folder())
        if writer.folder is not None and (_within(target, base) or _within(base, target)):
            writer.flush()


BEFORE_READING.append(flush_writers_of)


def _flush_at_exit() -> None:
    """Registered with the first writer: every run still being written is finished."""
    for writer in list(_WRITERS):
        try:
            writer.flush()
        except SavedRunError as exc:  # the process is ending: say what was lost, once
            print(f"fxdebug: {exc}", file=sys.stderr)
