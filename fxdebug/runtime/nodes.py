"""The functions that fxdebug's inserted nodes call, and the Recorder they write to.

Generated code looks like this (resnet18, ``capture="modules"``)::

    fxdebug_recorder = self.fxdebug_recorder
    begin_run = fxdebug_runtime_begin_run(fxdebug_recorder, (x,))
    conv1 = self.conv1(x)
    capture_conv1 = fxdebug_runtime_capture(fxdebug_recorder, conv1, 'conv1', 'Conv2d')
    bn1 = self.bn1(conv1)
    capture_bn1 = fxdebug_runtime_capture(fxdebug_recorder, bn1, 'bn1', 'BatchNorm2d', clone = True)
    relu = self.relu(bn1)            # in place: that is why bn1's capture clones

Each function is registered with ``torch.fx.node.has_side_effect`` so
``eliminate_dead_code`` keeps the node, and emits itself again when called
with fx Proxies, so re-tracing (and ``torch.load`` of a saved GraphModule,
which re-traces) keeps the nodes. While ``torch.compile`` traces them
(``torch.compiler.is_compiling()``), they emit fxdebug's custom ops instead,
which record what the compiled code computed (:mod:`.compiled_ops`). The
runtime never imports the passes.
"""

from __future__ import annotations

import threading

import torch
import torch.fx as fx
from torch.compiler import is_compiling, is_dynamo_compiling
from torch.fx.node import has_side_effect, map_aggregate

from .compiled_ops import (ID_ATTR, compiled_begin_run, compiled_capture, register_recorder,
                           start_run)
from .records import Records
from .stats_batch import BATCH_DTYPES, CPU_BATCH_NUMEL, SMALL
from ..stats.kernel import MIN_NUMEL
from ..base.torch_compat import read_version

__all__ = ["Recorder", "RECORDER_ATTR", "begin_run", "capture", "capture_stats",
           "emit_if_tracing"]

# The attribute of an instrumented GraphModule that holds its Recorder.
RECORDER_ATTR = "fxdebug_recorder"
STRIDED = torch.strided


class Recorder(torch.nn.Module):
    """Submodule ``fxdebug_recorder`` of an instrumented GraphModule: holds the latest Records.

    It has no parameters and is never called; capture nodes read it through a
    ``get_attr`` node. Each thread has its own latest Records: a forward
    running in another thread at the same time never writes into it.
    ``latest`` is the Records of the calling thread's latest forward, or, in
    a thread that never ran the module, of the forward started last in any
    thread. Copies and pickles of the module start with empty Records (the
    values of a run belong to that run, not to the model).

    >>> Recorder().latest.keys()
    []
    """

    # set by instrument(..., folder=) and fxdebug.set_step; read by every forward's begin_run
    # (class defaults: nn.Module finds a missing attribute only after a costly failed lookup)
    run_writer = None
    step = None
    # the Records class each forward's captures go to (a subclass of Records; None: Records)
    records_type: type | None = None

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []  # what the passes want every run's Records to say
        self.records_grads = False  # set by the GradHooks pass: Records.grads explains its absence
        # set by the Capture pass on a tensor-parallel model: capture key -> its module's
        # output layout (fxdebug.runtime.placement.plan_layouts); None: no tensor parallelism
        self.layouts: dict | None = None
        self._per_thread = threading.local()
        self._started_last = Records(grads_recorded=False)
        register_recorder(self)  # the id compiled code finds it by (fxdebug_compiled_id)

    @property
    def latest(self) -> Records:
        own = getattr(self._per_thread, "records", None)
        return self._started_last if own is None else own

    @latest.setter
    def latest(self, records: Records) -> None:
        self._per_thread.records = records
        self.__dict__["_started_last"] = records  # what nn.Module.__setattr__ does, without its checks

    def forward(self, *args, **kwargs):
        raise TypeError("Recorder holds fxdebug's Records and is not callable; "
                        "use fxdebug.records(gm) to read them.")

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_per_thread", None)
        state.pop(ID_ATTR, None)  # a copy registers itself anew
        state.pop("run_writer", None)  # a copy keeps its captures in memory (folder=: the original's)
        state["_started_last"] = Records(grads_recorded=state.get("records_grads", False))
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._per_thread = threading.local()
        register_recorder(self)


def _first_proxy(*values):
    # torch.fx's own walk of call arguments (in C++ since torch 2.6; ~30x faster than
    # fxdebug.runtime.values), because this runs on every capture; proxies only sit where
    # fx records arguments, which is exactly what map_aggregate walks
    found = []

    def visit(value):
        if isinstance(value, fx.Proxy) and not found:
            found.append(value)
        return value

    map_aggregate(values, visit)
    return found[0] if found else None


def emit_if_tracing(fn, args, kwargs):
    """Under re-tracing (an fx Proxy among the arguments): emit ``fn`` as a node and return its proxy."""
    proxy = _first_proxy(args, kwargs)
    if proxy is None:
        return None
    return proxy.tracer.create_proxy("call_function", fn, args, kwargs)


@has_side_effect
def begin_run(recorder: Recorder, inputs: tuple):
    """Start a new Records for this forward; ``inputs`` are the placeholders (kept for re-tracing)."""
    if is_compiling():  # torch.compile traces: the compiled code starts the run
        compiled_begin_run(recorder)
        return None
    emitted = emit_if_tracing(begin_run, (recorder, inputs), {})
    if emitted is not None:
        return emitted
    start_run(recorder)
    return None


@has_side_effect
def capture(recorder: Recorder, value, key: str, op: str, clone: bool = False):
    """Keep ``value`` (a tensor or nested structure of tensors) under ``key``.

    Tensors are stored as detached views; ``clone=True`` (set by the capture
    pass when a later in-place op writes to the value) stores a copy. Under
    ``torch.compile`` the compiled code's value is always copied (see
    :mod:`.compiled_ops`).
    """
    if type(value) is torch.Tensor and not is_dynamo_compiling():
        # the common case, first: one plain tensor in an eager forward (torch.export and
        # AOTAutograd, which also count as compiling, trace with fake tensors, never plain ones)
        records = recorder.latest
        if type(records) is not Records:  # a part's recorder: a view that renames keys
            records.add(key, op, value, clone=clone)
        elif clone or records.layouts is not None:
            records.add_tensor(key, op, value, clone)
        else:  # records.add_tensor(key, op, value), inlined: this runs once per capture
            try:
                version = read_version(value)
            except (RuntimeError, AttributeError):  # an inference tensor has no version counter
                version = None
            records.pending.append((key, op, value.detach(), False, version))
        return None
    if is_compiling():  # torch.compile traces: a custom op records the compiled value
        compiled_capture(recorder, value, key, op, False)
        return None
    if not isinstance(value, torch.Tensor):  # fx re-tracing hands over a Proxy
        emitted = emit_if_tracing(capture, (recorder, value, key, op),
                                  {"clone": clone} if clone else {})
        if emitted is not None:
            return emitted
    recorder.latest.add(key, op, value, clone=clone)
    return None


@has_side_effect
def capture_stats(recorder: Recorder, value, key: str, op: str, clone: bool = False,
                  flush: bool = False):
    """Keep only summary statistics of ``value`` under ``key`` (constant memory per node).

    A small tensor's statistics are computed together with the others' when
    the last capture of the forward (``flush=True``, set by the capture pass)
    has run (:mod:`.stats_batch`); ``clone=True`` (a later in-place op writes
    to the value) keeps a copy of it until then.
    """
    if type(value) is torch.Tensor and not is_dynamo_compiling():  # one plain tensor, eager
        records = recorder.latest
        if type(records) is not Records:  # a part's recorder: a view that renames keys
            records.add(key, op, value, stats_only=True)
        elif clone or records.layouts is not None:
            records.add_stats(key, op, value, clone)
        else:  # records.add_stats(key, op, value) of a batchable() tensor, inlined: runs per capture
            numel, dtype = value.numel(), value.dtype
            try:
                version = read_version(value)
            except (RuntimeError, AttributeError):  # an inference tensor: add_stats copies it
                version = None
            if (numel < CPU_BATCH_NUMEL or (numel < MIN_NUMEL and not value.is_cpu)) \
                    and dtype in BATCH_DTYPES and version is not None \
                    and value.layout is STRIDED and not value.is_meta:
                batch = records._small
                records.pending.append((key, op, batch, SMALL, len(batch.tensors)))
                if batch.add(value, version, dtype, numel):
                    records.flush_stats()
            else:
                records.add_stats(key, op, value)
        if flush:
            records.flush_stats()
        return None
    if is_compiling():  # torch.compile traces: graph ops summarize the compiled value
        compiled_capture(recorder, value, key, op, True, in_graph=type(recorder) is Recorder)
        return None
    if not isinstance(value, torch.Tensor):  # fx re-tracing hands over a Proxy
        kwargs = {"clone": clone} if clone else {}
        if flush:
            kwargs["flush"] = True
        emitted = emit_if_tracing(capture_stats, (recorder, value, key, op), kwargs)
        if emitted is not None:
            return emitted
    records = recorder.latest
    if type(value) is torch.Tensor and type(records) is Records:
        records.add_stats(key, op, value, clone)
    else:
        records.add(key, op, value, stats_only=True)
    if flush:
        records.flush_stats()
    return None
