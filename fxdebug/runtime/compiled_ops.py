"""What fxdebug's nodes do while ``torch.compile`` traces them: custom ops the compiled code calls.

Call tree::

    torch.compile(fxdebug.instrument(model))(x)
      dynamo traces gm.forward; each node function sees torch.compiler.is_compiling():
      ├─ begin_run(recorder, inputs)        -> fxdebug::begin_run(token, recorder id)
      ├─ capture(recorder, v, key, op)      -> fxdebug::capture(token, t, id, key, op, False)
      ├─ capture_stats(recorder, v, ...)    -> the statistics of each tensor t of v as graph
      │                                        ops, handed out once per graph (.compiled_stats);
      │                                        fxdebug::capture(token, t, id, key, op, True) for
      │                                        a t graph ops cannot summarize (keys as
      │                                        Records.add names them; fxdebug::note for a
      │                                        skipped leaf)
      └─ record_grads(recorder, v, ...)     -> compiled_grads.register_grad_hooks: runs
                                               eagerly (torch.compiler.disable: a graph break)
    the compiled code runs
      └─ each op, with the real tensor:     the Recorder (found by its id) .latest.add(...):
                                            a copy (tensor mode) or statistics (stats mode)

Dynamo, AOTAutograd and inductor handle a custom op by design: it is one node
of the graph, run where the program runs it, with the value the compiled code
computed at that point (after functionalization: an in-place op later in the
graph cannot change what the op was handed). Inside an inductor graph that
tensor may live in a buffer inductor reuses later, so the op keeps a copy, or
takes its statistics at once; it never keeps a view.

An op with no output would be dead code. Every op here writes to one token
tensor (``mutates_args``), so fx, AOTAutograd and inductor keep it (an op
registered with ``torch.fx.node.has_side_effect`` alone is dropped by
inductor's scheduler on torch 2.9) and run the ops in program order (each
depends on the one before through the token). The token holds no data.

The ops are tagged ``cudagraph_unsafe``: a CUDA graph replay would skip
them, so inductor runs them outside CUDA graphs (``mode="reduce-overhead"``).
They are registered once per process, when the first Recorder is made (not
at import: registering costs milliseconds).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from .compiled_stats import SINK_ATTR, StatsSink, graph_summary, summarizable_in_graph
from .records import Records
from .values import flatten_tensors

__all__ = ["register_recorder", "ensure_ops", "start_run", "compiled_begin_run",
           "compiled_capture"]

# Every op writes this tensor: nothing is dead code, everything runs in program order.
_TOKEN = torch.empty(0)
_RECORDERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_LOCK = threading.Lock()
_OPS: dict[str, Any] = {}
ID_ATTR = "fxdebug_compiled_id"


def register_recorder(recorder) -> int:
    """Give ``recorder`` a process-wide id the compiled ops find it by; registers the ops too.

    >>> from fxdebug.runtime import Recorder
    >>> rec = Recorder()
    >>> _RECORDERS[register_recorder(rec)] is rec
    True
    """
    ensure_ops()
    number = next(_IDS)
    _RECORDERS[number] = recorder
    object.__setattr__(recorder, ID_ATTR, number)
    object.__setattr__(recorder, SINK_ATTR, StatsSink())  # where compiled statistics go
    return number


def _recorder(number: int):
    found = _RECORDERS.get(number)
    if found is None:
        raise RuntimeError(f"fxdebug: the compiled code records into recorder {number}, which no "
                           f"longer exists (its module was deleted); compile the instrumented "
                           f"module again.")
    return found


def start_run(recorder) -> None:
    """A new Records in ``recorder.latest`` (or the next run of an accumulation): a forward starts.

    >>> from fxdebug.runtime import Recorder
    >>> rec = Recorder()
    >>> before = rec.latest
    >>> start_run(rec); rec.latest is before
    False
    """
    latest = recorder.latest
    writer = getattr(recorder, "run_writer", None)
    if latest.accumulating:
        latest.start_run()  # statistics merge over runs (fxdebug.accumulate_stats)
    elif writer is not None:  # instrument(..., folder=path)
        latest = recorder.latest = writer.start_run(getattr(recorder, "records_grads", None),
                                                    getattr(recorder, "notes", ()),
                                                    getattr(recorder, "step", None))
    else:
        make = getattr(recorder, "records_type", None) or Records
        latest = make(grads_recorded=getattr(recorder, "records_grads", None))
        latest.notes.extend(getattr(recorder, "notes", ()))
        latest.step = getattr(recorder, "step", None)  # fxdebug.set_step
        recorder.latest = latest
    latest.layouts = getattr(recorder, "layouts", None)  # tensor parallelism


def _begin_run(token: torch.Tensor, recorder: int) -> None:
    found = _recorder(recorder)
    start_run(found)
    sink = getattr(found, SINK_ATTR, None)
    if sink is not None:
        sink.start(found.latest)


def _capture(token: torch.Tensor, value: torch.Tensor, recorder: int, key: str, op: str,
             stats_only: bool) -> None:
    records = _recorder(recorder).latest
    if stats_only:  # at once: the buffer may hold another value later
        records.add(key, op, value, stats_only=True, reuse=False)
    else:  # a copy: the buffer may hold another value later
        records.add(key, op, value, clone=True)


def _note(token: torch.Tensor, recorder: int, text: str) -> None:
    _recorder(recorder).latest.notes.append(text)


def ensure_ops() -> None:
    """Register ``fxdebug::begin_run``, ``fxdebug::capture`` and ``fxdebug::note`` (once).

    >>> ensure_ops()
    >>> str(torch.ops.fxdebug.capture.default._schema).split("(")[0]
    'fxdebug::capture'
    """
    if _OPS:
        return
    with _LOCK:
        if _OPS:
            return
        ops = {}
        for name, fn in (("begin_run", _begin_run), ("capture", _capture), ("note", _note)):
            try:
                op = torch.library.custom_op(f"fxdebug::{name}", fn, mutates_args=("token",),
                                             tags=(torch.Tag.cudagraph_unsafe,))
                op.register_fake(_nothing)
            except RuntimeError:  # registered by another copy of fxdebug in this process
                pass
            ops[name] = getattr(torch.ops.fxdebug, name)
        _OPS.update(ops)


def _nothing(*args, **kwargs) -> None:
    return None


def compiled_begin_run(recorder) -> None:
    """``begin_run`` as dynamo records it: one op, run where the compiled code starts a forward.

    Called while dynamo traces (see :func:`compiled_capture` for an example).
    """
    _OPS["begin_run"](_TOKEN, getattr(recorder, ID_ATTR))
    sink = getattr(recorder, SINK_ATTR, None)
    if sink is not None:
        sink.pending = ()  # this run's summaries (.compiled_stats)


def _in_graph_stats(recorder) -> bool:
    """Whether compiled statistics of ``recorder`` are taken by graph ops (read while dynamo traces:
    a saved run or a tensor-parallel model takes the op per capture)."""
    return (getattr(recorder, SINK_ATTR, None) is not None
            and getattr(recorder, "run_writer", None) is None
            and getattr(recorder, "layouts", None) is None)


def _shape(tensor: torch.Tensor) -> Any:
    """A summarized tensor's shape as its entry holds it: a graph after a graph break reads the
    entries before it, and dynamo guards on the numbers of a tuple it reads (the graph would be
    compiled anew for each size), not on a tensor's values. On the CPU, a tensor of the sizes;
    elsewhere the tuple (a CPU tensor would keep a CUDA graph from being recorded, and a device
    tensor would cost a device read per capture when the Records fill)."""
    if tensor.device.type == "cpu":
        return torch.tensor(tensor.shape)
    return tuple(tensor.shape)


def compiled_capture(recorder, value: Any, key: str, op: str, stats_only: bool,
                     in_graph: bool = False) -> None:
    """``capture``/``capture_stats`` as dynamo records them: one op per tensor of ``value``,
    or, for statistics with ``in_graph`` (a Recorder whose runs are plain Records), graph ops.

    >>> import fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU(inplace=True)))
    >>> _ = torch.compile(gm, backend="aot_eager")(torch.tensor([-1.0, 2.0]))
    >>> fxdebug.records(gm)["0"].tolist()   # what the compiled in-place ReLU wrote
    [0.0, 2.0]
    >>> fxdebug.records(gm).record("0").copied   # compiled code's value: always a copy
    True
    """
    number = getattr(recorder, ID_ATTR)
    skipped: list = []
    tensors = flatten_tensors(value, key, skipped)  # Records.add's keys, read while dynamo traces
    in_graph = in_graph and stats_only and _in_graph_stats(recorder)
    sink = getattr(recorder, SINK_ATTR, None)
    for name, tensor in tensors:
        entry: tuple
        if in_graph and summarizable_in_graph(tensor):  # graph ops; no Python when it runs
            entry = (name, op, _shape(tensor), tensor.dtype, graph_summary(tensor))
        else:
            _OPS["capture"](_TOKEN, tensor, number, name, op, stats_only)
            entry = (name, op, None, None, None)  # its place in the order of the Records
        if in_graph and sink is not None:
            sink.pending = (sink.pending or ()) + (entry,)
    for text in skipped:
        _OPS["note"](_TOKEN, number, text)
