"""``instrument()`` and ``records()``: the two calls most users need.

Call tree::

    instrument(model)                      a transaction: any failure puts the model back
      ├─ frontend.unwrap_compiled(model)   torch.compile(m) given: instrument m, one warning
      ├─ partial.is_partial(model)         already part by part: instrument_parts, below
      ├─ tracing.keyed_copy(gm)            a GraphModule: the caller's module is never edited
      ├─ frontend.trace_in_transaction     any other module: traced (fx, else export)
      │    └─ TraceFailure of the root:     partial.instrument_parts(model, _instrument_part):
      │                                     each module traced when first called, specialised
      │                                     to the call, instrumented by the same pipeline;
      │                                     what cannot be traced runs eagerly
      ├─ run_pipeline(gm, build_pipeline(...) + passes)
      │    ├─ passes.Capture(...)          capture nodes + recorder
      │    ├─ passes.GradHooks(...)        with grads=True: gradient-recording nodes
      │    ├─ passes.EagerRegions(...)     leaf modules called as one node (auto-leaves,
      │    │                               TransformerEncoder): capture inside them too
      │    ├─ user passes                  run in the order given (all by
      │    │                               passes.base.run_passes: lint after each that
      │    │                               may have changed the graph, a failure named)
      │    └─ DebugGraphModule.defer_recompile()   once, after every pass: the code is
      │                                    generated on first use
      ├─ tracing.modes.follow_modes(gm, model, ...)   its graph follows model.train()/eval()
      └─ runs.run_writer.RunWriter         with folder=: each run streamed to the folder
    gm(x)                                  begin_run, then every capture node
    torch.compile(gm)(x)                   the same nodes as custom ops in the compiled
                                           graphs: the compiled code's values (see
                                           runtime/compiled_ops.py)
    records(gm)                            the Records of that run
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import torch.fx as fx

from .errors import FxdebugError, TraceFailure, deprecated, renamed_arguments
from .passes import Capture, EagerRegions, GradHooks, Pass, as_pass
from .passes.base import run_passes
from .runtime import RECORDER_ATTR, Recorder, Records, capture, capture_stats
from .runs.run_writer import RunWriter
from .runs.saved_runs import load_records
from .runtime.placement import parameter_pieces
from .base.torch_compat import compiled_inner
from .partial import instrument_parts, is_partial
from .tracing import keyed_copy
from .frontend import trace_in_transaction, unwrap_compiled
from .tracing.fx_tracer import trace_fx
from .tracing.graph_module import DebugGraphModule
from .tracing.modes import follow_modes
from .tracing.pipelining import refuse_pipelining
from .tracing.keys import META_SOURCE
from .base.formatting import format_location
from .tracing.selection import candidates
from .tracing.transaction import model_transaction

__all__ = ["instrument", "records", "accumulate_stats", "build_pipeline", "run_pipeline",
           "set_step", "flush"]


@renamed_arguments({"save_to": "folder"})
def instrument(model: torch.nn.Module, capture="modules", depth: int | None = None,
               include=None, exclude=None, grads: bool = False, mode: str = "tensor",
               passes: Sequence = (), folder: str | os.PathLike | None = None) -> torch.nn.Module:
    """Trace ``model`` (unless it is a GraphModule) and insert capture nodes.

    Args:
        model: an ``nn.Module`` or a ``torch.fx.GraphModule``. It is not
            modified; the result shares its parameters.
        capture: ``"modules"`` (every module call, each call of a reused
            module separately), ``"all"`` (every node) or a list of keys /
            globs. ``[]`` inserts no capture nodes.
        depth: only keys nested at most this deep (``key.count(".")``).
        include / exclude: keys or globs to keep / drop.
        grads: also record the gradient of every selected activation during
            backward (``records(gm).grads[key]``); parameter gradients
            appear in ``records(gm).table()``.
        mode: ``"tensor"`` keeps captured values, ``"stats"`` keeps only
            mean/std/min/max/zeros %/non-finite count.
        passes: more passes (``fxdebug.passes.Pass`` or functions
            ``gm -> gm``) run after the capture pass.
        folder: a folder (``save_to=`` before): every forward is written there as a
            numbered run (``run-000001``, ...) while it runs, and its captures leave
            memory once written (see :mod:`fxdebug.runs.run_writer`);
            ``records(gm)`` finishes writing and reads the latest run back,
            :func:`load_records` any run, :func:`set_step` tags runs.

    Returns:
        ``torch.nn.Module``: usually a ``torch.fx.GraphModule`` whose graph and
        code show the capture nodes. Run it, then read :func:`records`. When the root module
        cannot be traced even with auto-leaf, the model comes back partially
        instrumented instead (a copy of it whose largest traceable submodules
        are traced and instrumented when first called, the rest eager, see
        :mod:`fxdebug.partial`); a warning after its first run lists
        what ran eagerly and why, and ``records()`` works the same. Tell the
        two apart with ``isinstance(result, torch.fx.GraphModule)``.

    Compiled models: ``torch.compile(instrument(model))`` records what the
    compiled code computes (every capture equals eager's up to the
    compiler's float error; in tensor mode a copy, never a view; with
    ``grads=True`` each gradient-recording node is a graph break, the hooks
    are registered eagerly; ``fullgraph=True`` refuses that, saying why). ``instrument(torch.compile(model))`` instruments
    the module inside and returns an eager module, with one
    :class:`~fxdebug.errors.EagerFallbackWarning` saying so;
    ``torch.compile(model, backend=fxdebug.backend(...))`` records the
    compiled graphs without instrumenting the model.

    Example::

        >>> import torch, torchvision, fxdebug
        >>> gm = fxdebug.instrument(torchvision.models.resnet18(), depth=1)
        >>> out = gm(torch.randn(1, 3, 64, 64))
        >>> rec = fxdebug.records(gm)
        >>> rec["layer1.0"].shape
        torch.Size([1, 64, 16, 16])
    """
    refuse_pipelining(model, "fxdebug.instrument")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxdebug.instrument expects an nn.Module or a GraphModule, "
                        f"got {type(model).__name__}.")
    with model_transaction(model, "fxdebug.instrument") as snapshot:  # a failure: put back
        return _instrument(model, capture, depth, include, exclude, grads, mode, passes, folder,
                           snapshot)


def _instrument(model, capture, depth, include, exclude, grads, mode, passes,
                folder, snapshot) -> torch.nn.Module:
    inner = unwrap_compiled(model, "fxdebug.instrument")
    if inner is not model:
        model, snapshot = inner, None  # the snapshot is the wrapper's
    arguments = dict(capture=capture, depth=depth, include=include, exclude=exclude,
                     grads=grads, mode=mode)
    user_passes = [as_pass(p) for p in passes]
    instrument_part = functools.partial(_instrument_part, user_passes=user_passes)
    if is_partial(model):
        return _saving(instrument_parts(model, instrument_part, **arguments), folder)
    gm: fx.GraphModule
    if isinstance(model, fx.GraphModule):
        gm = keyed_copy(model, recompile=False)  # run_pipeline recompiles once
    else:
        try:
            gm = trace_in_transaction(model, snapshot)  # nothing has run on the model since
        except TraceFailure as failure:  # the root cannot be traced: instrument its parts
            if next(model.children(), None) is None:
                raise  # no submodules: there are no parts, the TraceFailure says what to do
            return _saving(instrument_parts(model, instrument_part, **arguments,
                                            failure=failure), folder)
    gm = run_pipeline(gm, build_pipeline(**arguments) + user_passes)
    if not isinstance(model, fx.GraphModule):  # its graph follows model.train() / eval()
        follow_modes(gm, model, functools.partial(_instrument_mode, arguments=arguments,
                                                  user_passes=user_passes), _after_mode_switch)
    recorder = getattr(gm, RECORDER_ATTR, None)
    if not isinstance(recorder, Recorder):
        # nothing selected: remember the call, so records(gm) can say why it has nothing
        # nn.Module's stubs type attributes as Tensor | Module; a module takes any value
        gm.fxdebug_instrumented = _describe_call(  # type: ignore[assignment]
            model, arguments, passes)
        return gm
    locations = capture_locations(gm)
    recorder.locations = locations  # type: ignore[assignment]  # (a module takes any value)
    if folder is not None:
        writer = RunWriter(folder)
        writer.locations = locations
        recorder.run_writer = writer  # type: ignore[assignment]
    return gm


def capture_locations(gm: fx.GraphModule) -> dict[str, str]:
    """``{key: "file:line"}``: where the code of each captured node is, from the graph."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (capture, capture_stats) \
                or len(node.args) < 3 or not isinstance(node.args[1], fx.Node):
            continue
        source = node.args[1].meta.get(META_SOURCE)
        if source is not None:
            found[str(node.args[2])] = format_location(source)
    return found


def _instrument_mode(model: torch.nn.Module, gm: fx.GraphModule, arguments: dict,
                     user_passes) -> fx.GraphModule:
    """``model`` traced and instrumented as ``gm`` was, in the modes it is in now; its captures
    go to ``gm``'s recorder."""
    traced = trace_fx(model, warn=False)
    recorder = getattr(gm, RECORDER_ATTR, None)
    if isinstance(recorder, Recorder):
        traced.add_submodule(RECORDER_ATTR, recorder)
    return run_pipeline(traced, build_pipeline(**arguments) + user_passes, recompile=False)


def _after_mode_switch(gm: fx.GraphModule) -> None:
    """The captures of the graph of another mode are at their own source lines."""
    recorder = getattr(gm, RECORDER_ATTR, None)
    if isinstance(recorder, Recorder):
        recorder.locations = capture_locations(gm)  # type: ignore[assignment]
        writer = getattr(recorder, "run_writer", None)
        if writer is not None:
            writer.locations = recorder.locations


def _saving(partial: torch.nn.Module, folder) -> torch.nn.Module:
    """A part-by-part model that writes each run to ``folder`` (if given): its one shared
    recorder, which every part and eager capture writes into, streams as a traced one does."""
    recorder = getattr(partial, RECORDER_ATTR, None)
    if folder is not None and isinstance(recorder, Recorder):
        writer = RunWriter(folder)
        writer.locations = {}
        recorder.run_writer = writer  # type: ignore[assignment]
    return partial


def _describe_call(model, arguments: dict, passes) -> str:
    defaults = dict(capture="modules", depth=None, include=None, exclude=None, grads=False,
                    mode="tensor")
    given = [f"{name}={value!r}" for name, value in arguments.items() if value != defaults[name]]
    if passes:
        given.append(f"passes=[{', '.join(as_pass(p).name for p in passes)}]")
    return f"fxdebug.instrument({', '.join([type(model).__name__] + given)})"


def _instrument_part(gm: fx.GraphModule, arguments: dict | None, user_passes) -> fx.GraphModule:
    """How a part-by-part model instruments one traced part: the pipeline of ``instrument()``
    (``arguments`` None: the selection picks nothing in the part, only the user's passes)."""
    pipeline = build_pipeline(**arguments) if arguments is not None else []
    return run_pipeline(gm, pipeline + list(user_passes), recompile=False)


def build_pipeline(capture="modules", depth=None, include=None, exclude=None, grads=False,
                   mode="tensor", passes=()) -> list:
    """The passes ``instrument()`` runs for these arguments, in order.

    >>> [p.name for p in build_pipeline(grads=True)]
    ['capture', 'grads', 'eager_regions']
    """
    pipeline: list[Pass] = []
    if not (isinstance(capture, (list, tuple)) and len(capture) == 0):
        pipeline.append(Capture(capture, depth=depth, include=include, exclude=exclude, mode=mode))
    if grads:
        selection = "modules" if isinstance(capture, (list, tuple)) and not capture else capture
        pipeline.append(GradHooks(selection, depth=depth, include=include, exclude=exclude,
                                  mode=mode))
    if pipeline:  # the leaf modules the graph calls as one node: capture inside them too
        pipeline.append(EagerRegions(capture, depth=depth, include=include, exclude=exclude,
                                     grads=grads, mode=mode))
    pipeline.extend(as_pass(p) for p in passes)
    return pipeline


def run_pipeline(gm: fx.GraphModule, pipeline, recompile: bool = True) -> fx.GraphModule:
    """Run ``pipeline`` on ``gm`` (in place where the passes allow) through the one pass
    runner, :func:`fxdebug.passes.base.run_passes`; then recompile once.

    The code is generated on first use (a call, ``gm.code``): see ``defer_recompile``.
    """
    gm = run_passes(gm, pipeline).graph_module
    if recompile:
        if isinstance(gm, DebugGraphModule):
            gm.defer_recompile()
        else:
            gm.recompile()
    return gm


def records(gm: torch.nn.Module) -> Records:
    """The Records of the latest forward of an instrumented module (``instrument(model)``,
    ``torch.compile`` of one) or of a model compiled with ``backend=fxdebug.backend()`` (pass
    the backend). For a module instrumented with ``folder=``, the run is finished writing
    and read back from disk.

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        >>> _ = gm(torch.ones(3, 2))
        >>> fxdebug.records(gm)["0"].shape
        torch.Size([3, 2])
    """
    gm = compiled_inner(gm) or gm  # torch.compile(instrument(model)): the module inside
    recorder = getattr(gm, RECORDER_ATTR, None)
    if not isinstance(recorder, Recorder) and isinstance(gm, fx.GraphModule):
        call = getattr(gm, "fxdebug_instrumented", None)
        if call is not None:
            raise FxdebugError(_nothing_selected(gm, call))
    if not isinstance(recorder, Recorder):
        raise FxdebugError(
            f"{type(gm).__name__} has no fxdebug recorder, so nothing was captured. "
            f"Use gm = fxdebug.instrument(model), run gm(inputs), then fxdebug.records(gm).")
    shared = getattr(recorder, "shared", None)
    if isinstance(shared, Recorder):  # a traced part of a partially instrumented model
        return shared.latest
    latest = recorder.latest
    writer = getattr(recorder, "run_writer", None)
    if writer is not None and writer.folder is not None:  # folder=: the latest run, from disk
        _flush_writer(gm, writer)
        return load_records(writer.folder)
    if isinstance(gm, torch.nn.Module):  # (fxdebug.backend(): the compiled model owns them)
        latest.bind_parameters(gm.named_parameters())
    latest.locations = getattr(recorder, "locations", {})
    return latest


def _recorder_of(gm: torch.nn.Module, caller: str) -> Recorder:
    recorder = getattr(compiled_inner(gm) or gm, RECORDER_ATTR, None)
    if not isinstance(recorder, Recorder):
        raise FxdebugError(f"{caller}: {type(gm).__name__} is not a module returned by "
                           f"fxdebug.instrument(model). Instrument the model first.")
    return recorder


def set_step(gm: torch.nn.Module, step) -> None:
    """Tag the runs of ``gm`` that start from now on with ``step`` (a training step, an epoch).

    The step is saved with each run (``load_records(path).context["step"]``,
    ``records(gm).step``) until the next call; ``None`` stops tagging.

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
        >>> fxdebug.set_step(gm, 10)
        >>> _ = gm(torch.ones(2))
        >>> fxdebug.records(gm).step
        10
    """
    _recorder_of(gm, "set_step").step = step


def flush(gm: torch.nn.Module) -> None:
    """Deprecated: :func:`records` finishes writing what ``instrument(..., folder=)`` queued
    (every capture and the latest run's manifest) and reads the run back;
    :func:`~fxdebug.load_records` of that folder and the process's exit finish it too.

    Example::

        >>> import os, tempfile, warnings, torch, fxdebug
        >>> folder = os.path.join(tempfile.mkdtemp(), "runs")
        >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), folder=folder)
        >>> _ = gm(torch.ones(2))
        >>> fxdebug.records(gm).keys()   # instead of fxdebug.flush(gm)
        ['0']
    """
    deprecated("fxdebug.flush(gm)", "fxdebug.records(gm), which finishes writing the run and "
               "reads it back (load_records(folder) and the process's exit finish it too)")
    writer = getattr(_recorder_of(gm, "flush"), "run_writer", None)
    if writer is not None:
        _flush_writer(compiled_inner(gm) or gm, writer)


def _flush_writer(gm: torch.nn.Module, writer: RunWriter) -> None:
    """The parameter gradients' statistics go with the latest run; then everything is written."""
    if writer.folder is not None:
        writer.set_parameters(parameter_pieces(gm.named_parameters()))  # DTensor grads: pieces
    writer.flush()


def _nothing_selected(gm: fx.GraphModule, call: str) -> str:
    """Why an instrumented module has no Records: what it was asked to capture, what there was."""
    modules = candidates(gm, every_node=False)
    every = candidates(gm, every_node=True)
    if modules:
        there = (f"its graph has {len(modules)} module call(s) "
                 f"({', '.join(t.key for t in modules[:5])}{', ...' if len(modules) > 5 else ''})")
    elif every:
        there = (f"its graph calls no submodule; its {len(every)} other node(s) "
                 f"({', '.join(t.key for t in every[:5])}{', ...' if len(every) > 5 else ''}) "
                 f"are captured with capture='all'")
    else:
        there = "its graph computes nothing (the output is an input, as in nn.Identity)"
    return (f"{call} selected no node, so no capture node was inserted and nothing is recorded: "
            f"{there}. Widen the selection (capture='all', a depth, include=[...]) or drop "
            f"the exclude patterns that removed everything.")


def accumulate_stats(gm: torch.nn.Module, enabled: bool = True) -> Records:
    """Make a ``mode="stats"`` module merge statistics over runs instead of keeping the last run's.

    From the next forward on, ``records(gm)`` holds, per key, the running
    count, mean, std, min, max, zeros and non-finite counts over every run
    since this call (``records(gm).runs`` of them); no run's tensors are kept.
    Calling it again starts a fresh accumulation; ``enabled=False`` goes back
    to one run at a time.

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), mode="stats")
        >>> _ = fxdebug.accumulate_stats(gm)
        >>> _ = gm(torch.tensor([1.0, -1.0])); _ = gm(torch.tensor([3.0, 5.0]))
        >>> s = fxdebug.records(gm)["0"]
        >>> fxdebug.records(gm).runs, s.mean, s.max, s.zeros_pct
        (2, 2.25, 5.0, 25.0)
    """
    gm = compiled_inner(gm) or gm
    recorder = getattr(gm, RECORDER_ATTR, None)
    if not isinstance(recorder, Recorder) or isinstance(getattr(recorder, "shared", None), Recorder):
        raise FxdebugError(
            f"accumulate_stats: {type(gm).__name__} is not a module returned by "
            f"fxdebug.instrument(model, mode='stats') (a partially instrumented model does not "
            f"support accumulation yet). Instrument the model first.")
    fresh = Records()
    fresh.accumulating = enabled
    fresh.runs = 0
    recorder.latest = fresh
    return fresh
