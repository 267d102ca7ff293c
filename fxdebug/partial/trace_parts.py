"""Partial instrumentation: models whose root cannot be traced, traced part by part.

A detector's ``forward`` iterates over a list of images; RAFT compares input
shapes; transformers check their keyword arguments: fx cannot trace these
roots with symbolic arguments, even with auto-leaf. fxdebug then keeps the
model as a tree of *dispatchers* and traces each module when it is first
called, specialised to the call::

    instrument(model)                          trace(model) raised TraceFailure
      └─ instrument_parts(model, instrument_graph)
           └─ _Context.build(model)            a copy of every module (parameters and
                                               buffers shared); each one's forward is a
                                               _Dispatch
    model_copy(*inputs)
      └─ _Dispatch(module, path)(*args, **kwargs)
           ├─ call_plan: training flags, the structure of the arguments,
           │  the value of every non-tensor (None, flags, sizes)
           ├─ first call with it: trace_fx(module, concrete_args=...)
           │    ├─ works: a *part*: GraphModule with full-path keys
           │    │  ("backbone.body.layer1.0.conv1"), instrumented by instrument_graph
           │    │  (instrument()'s own pipeline, passed in), auto-leaves calling their
           │    │  own dispatchers
           │    └─ TraceFailure (or a call fx cannot specialise, such as **kwargs):
           ├─ export_plan: the same, plus every tensor's shape, dtype and device
           ├─ first call with that: export_trace(module, *args, example_kwargs=kwargs)
           │    ├─ works: a part (front end "export"), instrumented the same way
           │    └─ fails: *eager*, with both reasons (not tried again on this module)
           ├─ part: run the graph
           └─ eager: run the module's own forward (its children dispatch
              again) and capture its output

Tensors become graph inputs (also inside lists and dicts: ``fx.PH``); every
other argument is fixed, so ``token_type_ids=None`` or ``targets=None`` take
the branch they take eagerly, and a call with other values (or after
``model.train()``) gets a part of its own. A module whose arguments fxdebug
cannot specialise on (non-tensors through ``**kwargs``, as every Hugging Face
attention block is called) is exported with ``torch.export`` on that call
instead, specialised to its shapes and values; one whose arguments neither can
take (an ``ImageList``) runs eagerly, and says so.

The user's model is never modified. All parts and eager captures write into
one :class:`SharedRecorder` (the root's ``fxdebug_recorder``), so
``fxdebug.records(model)`` holds a run under full module paths, as for a
fully traced model; a module called several times in a run (the RPN head's
convolutions, once per feature level) gets keys ``path``, ``path_1``... as
forward hooks would name them.

What was traced and what ran eagerly, and why, is in ``model.fxdebug_partial``
(a :class:`PartialReport`; ``print(model.fxdebug_partial.summary())``) and in a
warning after the first run. Every traced part is an ordinary fxdebug
GraphModule: :func:`traced_parts` lists them and :func:`part_inputs` records
what each was called with, for ``check_equivalence``, ``diff``,
``print_tabular`` and ``dump`` on one part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from typing import Callable, Sequence

import torch
import torch.fx as fx

from .. import runtime
from ..errors import EagerFallbackWarning, TraceFailure
from ..runtime import RECORDER_ATTR, PartRecorder, SharedRecorder, begin_part, clone_inputs
from ..base import torch_compat
from .call_specialization import (CallPlan, ExportPlan, call_forward, call_plan, clean_tree, export_plan, is_container, is_fx_leaf, note_part_output, set_submodule, strip_guards)
from ..tracing.export import export_trace
from ..tracing.unsupported import why_not_export
from ..tracing.fx_tracer import trace_fx
from ..tracing.keys import META_KEY, join_path, prefix_keys
from ..tracing.locations import caller_stacklevel
from ..tracing.module_copy import shallow_module_copy
from ..tracing.modes import ModeLink
from .part_selection import Selection, key_plan
from .report import PARTIAL_REPORT_ATTR, EagerModule, PartialReport, TracedPart, is_partial
from ..tracing.selection import candidates

# instrument_graph(part, arguments or None) -> the instrumented part
InstrumentGraph = Callable[[fx.GraphModule, "dict | None"], fx.GraphModule]

__all__ = ["build_partial_model", "instrument_parts", "is_partial", "traced_parts", "part_inputs",
           "PartialReport", "TracedPart", "EagerModule", "InstrumentGraph"]


# -- the dispatchers -----------------------------------------------------------------------
class _Dispatch:
    """The ``forward`` of one module of a partial model: a traced part, or eager and captured."""

    def __init__(self, context: "_Context", module: torch.nn.Module, path: str,
                 traceable: bool) -> None:
        self.context, self.module, self.path, self.traceable = context, module, path, traceable
        # fx parts by call_plan signature (an EagerModule where fx failed), export parts by
        # export_plan signature (why not, where export was not tried or failed: eager)
        self.variants: list[tuple[tuple, fx.GraphModule | EagerModule]] = []
        self.exported: list[tuple[tuple, fx.GraphModule | str]] = []  # str: why eager

    def __call__(self, *args, **kwargs):
        context = self.context
        shared = context.shared
        outermost = shared.depth == 0
        if outermost:
            context.modes.current()  # the copies take the flags of model.train()/eval()
            runtime.begin_run(shared, ())
        shared.depth += 1
        try:
            with context.quiet():  # fxdebug's own work, and traced parts, are no eager ops
                part, positional = self._choose(args, kwargs)
                if part is not None:
                    context.note_inputs(part, positional)
                    output = part(*positional)
            if part is None:
                with context.region(self.path, self.module):
                    output = call_forward(self.module, args, kwargs)
                with context.quiet():
                    context.capture_eager(self, output)
        finally:
            shared.depth -= 1
        if outermost:
            context.after_run()
        return output

    def _choose(self, args, kwargs):
        """The part to run for this call and its positional arguments, or (None, None): eager.

        Symbolic tracing first (one part per :func:`call_plan` signature), then
        ``torch.export`` of this call (one part per :func:`export_plan` signature:
        shapes and every value fixed), then eager with both reasons.
        """
        if not self.traceable:
            return None, None
        plan = call_plan(self.module, args, kwargs)
        fx_failure: EagerModule | None = None
        if not plan.reason:
            found = next((part for signature, part in self.variants
                          if signature == plan.signature), _MISSING)
            if found is _MISSING:
                found = self.context.specialise(self, plan)
                if isinstance(found, TraceFailure):  # kept as the report line (deepcopy, pickle)
                    found = EagerModule.from_failure(self.path, self.module, found)
                self.variants.append((plan.signature, found))
            if isinstance(found, fx.GraphModule):
                return found, plan.positional
            fx_failure = found
        exported = export_plan(self.module, args, kwargs)
        if exported.reason:
            self.context.eager(self, fx_failure, plan.reason, f"not tried: {exported.reason}")
            return None, None
        found = next((part for signature, part in self.exported
                      if signature == exported.signature), _MISSING)
        if found is _MISSING:
            if len(self.exported) >= _EXPORT_LIMIT:
                self.context.eager(self, fx_failure, plan.reason, (
                    f"not tried: it was called with more than {_EXPORT_LIMIT} different shapes "
                    f"or values, each needing an export of its own"))
                return None, None
            found = self._why_not_export(fx_failure)
            if not found:
                found = self.context.export(self, exported, args, kwargs, fx_failure,
                                            plan.reason)
            self.exported.append((exported.signature, found))
        if isinstance(found, str):  # why export was not tried, or why it failed
            self.context.eager(self, fx_failure, plan.reason, found)
            return None, None
        return found, exported.positional

    def _why_not_export(self, fx_failure: EagerModule | None) -> str:
        """Why torch.export is not tried on this module (seconds each), or ``""``."""
        sharded = why_not_export(self.module)
        if sharded:
            return sharded
        if fx_failure is not None and fx_failure.kind.startswith(_EAGER_ONLY):
            return (f"not tried: fx found {fx_failure.kind.split(' (')[0].split(',')[0]}, "
                    f"which an exported graph would not do at run time either")
        dropout = next((path for path, sub in self.module.named_modules()
                        if isinstance(sub, torch_compat.DROPOUT_TYPES)
                        and sub.training and getattr(sub, "p", 0) > 0), None)
        if dropout is not None:
            return (f"not tried: {join_path(self.path, dropout) or '(root)'} is a dropout in "
                    f"train mode: random draws in an exported graph are not known to match "
                    f"eager ones")
        # failed once: other shapes fail the same way (not tried again; one report line)
        return next((part for _, part in self.exported if isinstance(part, str)), "")


_MISSING = object()
_EXPORT_LIMIT = 8  # export parts of one module (each a few seconds to make)
# what fx found that a graph cannot be faithful to, whichever front end makes it
_EAGER_ONLY = ("a traced value stored on the module", "torch.inference_mode()")


def _random_ops(gm: fx.GraphModule) -> list[str]:
    """The random ATen ops of an exported graph: nothing says they draw what eager code
    draws from the same seed (torch may decompose them), so such a part runs eagerly."""
    found: dict[str, None] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(
                target, "tags", ()):
            continue
        schema = torch_compat.op_schema(target).arguments
        given = {a.name: a.default_value for a in schema if a.has_default_value()}
        given.update(zip((a.name for a in schema), node.args), **node.kwargs)
        if given.get("train", True) is False or given.get("p", given.get("dropout_p")) == 0:
            continue  # dropout that draws nothing: eval mode, or attention with dropout_p=0
        found[str(target)] = None
    return list(found)


class _Context:
    """What the dispatchers of one partial model share."""

    def __init__(self, source: torch.nn.Module, selection: "Selection | None",
                 instrument_graph: InstrumentGraph | None = None, leaf_modules=(),
                 notes=()) -> None:
        self.source = source
        self.selection, self.instrument_graph = selection, instrument_graph
        self.report = PartialReport(type(source).__name__, notes=list(notes))
        self.shared = SharedRecorder()
        self.module_paths = dict.fromkeys(name for name, _ in
                                          source.named_modules(remove_duplicate=False))
        # a tensor-parallel model: each module output's layout (a ParallelStyle's), and for every
        # other capture, parts' and eager modules' alike, "local, placement unknown", never None
        self.shared.layouts = runtime.plan_layouts(source, {p: p for p in self.module_paths})
        self.leaf_paths = [leaf for leaf in leaf_modules if isinstance(leaf, str)]
        self.leaf_types = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type))
        self.parts: dict[str, fx.GraphModule] = {}
        self.modes = ModeLink([], [])  # the model's modules and their copies (build)
        self.seen_keys: dict[str, None] = {}
        self._eager_seen: dict[tuple[str, str, str], None] = {}
        self.recording: dict[str, tuple] | None = None
        self.runs = 0
        self.scope: runtime.EagerScope | None = None
        if selection is not None:  # ops inside eager modules (capture="all")
            self.scope = runtime.EagerScope(
                self.shared, selection, functools.partial(runtime.EagerKeys,
                                                          tuple(self.module_paths)),
                record_ops=selection.records_ops, seen=self._see)

    def _see(self, key: str) -> None:
        self.seen_keys[key] = None

    def quiet(self):
        """Record no eager op inside (fxdebug's own work, a traced part)."""
        active = self.scope is not None and self.scope.active()
        return self.scope.paused() if active else contextlib.nullcontext()

    def region(self, path: str, module: torch.nn.Module):
        """Record the ops of the eager module at ``path`` run inside (with capture="all");
        none inside a ``torch.nn`` leaf (``Linear``), which a graph shows as one node too."""
        if self.scope is None:
            return contextlib.nullcontext()
        if is_fx_leaf(module) and next(module.children(), None) is None:
            return self.quiet()
        return self.scope.region(path)

    # -- building ------------------------------------------------------------------------
    def build(self, model: torch.nn.Module) -> torch.nn.Module:
        memo: dict[int, torch.nn.Module] = {}

        def copy_tree(module: torch.nn.Module, path: str) -> torch.nn.Module:
            if id(module) in memo:
                return memo[id(module)]
            new = memo[id(module)] = shallow_module_copy(module, share_parameters=True)
            for name, child in torch_compat.own_children(module).items():
                if child is not None:
                    torch_compat.set_child(new, name, copy_tree(child, join_path(path, name)))
            if not is_container(module):
                leaf = (path in self.leaf_paths or isinstance(module, self.leaf_types)
                        or is_fx_leaf(module))
                new.__dict__["forward"] = _Dispatch(self, new, path, traceable=not leaf)
            return new

        root = copy_tree(model, "")
        sources = list(model.named_modules())
        self.modes = ModeLink(sources, [(index, memo[id(module)])
                                        for index, (_, module) in enumerate(sources)])
        root.__dict__[PARTIAL_REPORT_ATTR] = self.report
        if self.selection is not None:
            torch_compat.set_child(root, RECORDER_ATTR, self.shared)
        return root

    # -- tracing a part --------------------------------------------------------------------
    def specialise(self, dispatch: _Dispatch, plan: CallPlan) -> fx.GraphModule | TraceFailure:
        path, module = dispatch.path, dispatch.module
        inside = [leaf[len(path) + 1:] if path else leaf for leaf in self.leaf_paths
                  if not path or leaf.startswith(path + ".")]
        try:
            gm = trace_fx(clean_tree(module), leaf_modules=[*inside, *self.leaf_types],
                          concrete_args=plan.concrete_args, warn=False, keywords=plan.keywords,
                          root_hooks=False)  # the dispatcher's module(...) runs them  # the report lists them
        except TraceFailure as failure:
            return failure
        strip_guards(gm)
        prefix_keys(gm.graph, path)
        if path:
            note_part_output(gm, path, type(module).__name__)
        auto = [(join_path(path, rel), rel) for rel, _ in gm.meta.get("fxdebug_auto_leaves", ())]
        gm.meta["fxdebug_auto_leaves"] = [(join_path(path, rel), reason) for rel, reason in
                                          gm.meta.get("fxdebug_auto_leaves", ())]
        for _, rel in auto:
            set_submodule(gm, rel, module.get_submodule(rel))  # calls its own dispatcher
        return self._add_part(gm, dispatch, TracedPart(
            "", path, type(module).__name__, plan.description, tuple(full for full, _ in auto)))

    def export(self, dispatch: _Dispatch, plan: ExportPlan, args: tuple, kwargs: dict,
               fx_failure: EagerModule | None, fx_reason: str) -> fx.GraphModule | str:
        """The part ``torch.export`` makes of this call, or why it cannot (then it runs eagerly)."""
        path, module = dispatch.path, dispatch.module
        try:  # torch's own warnings and logs pass through: silencing them would silence every thread
            gm = export_trace(clean_tree(module), *args, example_kwargs=kwargs)
        except TraceFailure as failure:
            cause = failure.__cause__ or failure
            text = (str(cause).strip().splitlines() or [""])[0]
            text = text if len(text) <= 160 else text[:157] + "..."
            at = f" at {failure.location}" if failure.location else ""
            return f"torch.export failed{at}: {type(cause).__name__}: {text}"
        random = _random_ops(gm)
        if random:
            return (f"its exported graph draws random numbers ({', '.join(random)}), which "
                    f"are not known to match eager draws (dropout in train mode?)")
        prefix_keys(gm.graph, path)
        if path:
            note_part_output(gm, path, type(module).__name__)
        why = (f"{fx_failure.kind} at {fx_failure.location}" if fx_failure is not None
               else fx_reason)
        return self._add_part(gm, dispatch, TracedPart(
            "", path, type(module).__name__, plan.description, (), "export", why))

    def _add_part(self, gm: fx.GraphModule, dispatch: _Dispatch,
                  part: TracedPart) -> fx.GraphModule:
        path = dispatch.path
        label = path if path not in self.parts else \
            f"{path}@{sum(p.path == path for p in self.report.parts)}"
        gm.meta.update(fxdebug_part=label, fxdebug_frontend=part.frontend)
        gm = self._instrument(gm, label)
        self.parts[label] = gm
        self.report.parts.append(dataclasses.replace(part, label=label))
        return gm

    def _instrument(self, gm: fx.GraphModule, label: str) -> fx.GraphModule:
        self.seen_keys.update(dict.fromkeys(t.key for t in candidates(gm, every_node=True)))
        if self.selection is None or self.instrument_graph is None:
            gm.recompile()
            return gm
        arguments = self.selection.for_part([t.key for t in candidates(gm, every_node=True)])
        recorder = PartRecorder(self.shared, gm.meta["fxdebug_part"].partition("@")[0])
        gm.add_submodule(RECORDER_ATTR, recorder)
        gm = self.instrument_graph(gm, arguments)
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is runtime.begin_run:
                node.target = begin_part
                node.meta[META_KEY] = "begin_part"
        if any(node.op == "get_attr" and node.target == RECORDER_ATTR for node in gm.graph.nodes):
            recorder.plan = key_plan(gm, self.module_paths)
        else:
            delattr(gm, RECORDER_ATTR)
        gm.recompile()
        return gm

    # -- running ---------------------------------------------------------------------------
    def eager(self, dispatch: _Dispatch, failure: EagerModule | None, reason: str,
              export_reason: str = "") -> None:
        """Note that ``dispatch``'s module runs eagerly: why fx (``failure`` or ``reason``)
        and why export (``export_reason``) did not make a graph of it."""
        module, path = dispatch.module, dispatch.path
        if failure is not None:
            entry = failure
        else:
            entry = EagerModule(path, type(module).__name__, reason.split(",")[0], None,
                                f"module {path or '(root)'!r} ({type(module).__name__}) runs "
                                f"eagerly: {reason}.")
        entry = dataclasses.replace(entry, export_reason=export_reason)
        if (path, entry.reason, export_reason) not in self._eager_seen:
            self._eager_seen[(path, entry.reason, export_reason)] = None
            self.report.eager.append(entry)

    def capture_eager(self, dispatch: _Dispatch, output) -> None:
        path = dispatch.path
        if not path or self.selection is None:
            return
        self.seen_keys[path] = None
        count = self.shared.next_call(path)
        capture, grads = self.selection.for_eager(path)
        if not (capture or grads):
            return
        key = path if count == 0 else f"{path}_{count}"
        op = type(dispatch.module).__name__
        if capture is not None:
            # eager code may write to the output in place later: keep a copy
            self.shared.latest.add(key, op, output, clone=capture == "tensor",
                                   stats_only=capture == "stats", via=runtime.EAGER_MODULE)
        if grads is not None:
            runtime.record_grads(self.shared, output, key, op, stats_only=grads == "stats")

    def note_inputs(self, part: fx.GraphModule, positional: list) -> None:
        if self.recording is not None:
            label = part.meta["fxdebug_part"]
            if label not in self.recording:
                self.recording[label] = tuple(clone_inputs(list(positional)))

    def after_run(self) -> None:
        self.runs += 1
        if self.runs != 1:
            return
        if self.selection is not None:
            self.selection.check(list(self.seen_keys))
        if self.report.eager:
            logging.getLogger("fxdebug").info("partial tracing:\n%s", self.report.summary())
            warnings.warn(self.report.warning_text(), EagerFallbackWarning,
                          stacklevel=caller_stacklevel())


# -- entry points ------------------------------------------------------------------------
def _context_of(model: torch.nn.Module) -> _Context:
    dispatch = model.__dict__.get("forward")
    if not isinstance(dispatch, _Dispatch):
        raise TypeError(f"{type(model).__name__} is not a partially traced model made by fxdebug.")
    return dispatch.context


def build_partial_model(model: torch.nn.Module, failure: TraceFailure | None = None,
                        leaf_modules=(), notes=()) -> torch.nn.Module:
    """A copy of ``model`` that traces each module when it is first called; the rest runs eagerly.

    What ``fxdebug.trace(model, frontend="auto")`` returns when neither fx nor
    export can trace the whole model. Pass it to :func:`fxdebug.instrument`;
    :func:`traced_parts` lists the parts it has traced.

    Args:
        model: the module; it is not modified (the copy shares its parameters
            and buffers).
        failure: the TraceFailure of the root with symbolic arguments, when known.
        leaf_modules: as for :func:`fxdebug.trace` (paths from the root, or classes).
        notes: lines saying why whole-model front ends were not used.

    Example::

        >>> import torch, fxdebug, warnings
        >>> class Loop(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        ...     def forward(self, xs):
        ...         if len(xs) > 1:
        ...             return [self.stem(x) for x in xs]
        ...         return self.stem(xs[0])
        >>> partial = build_partial_model(Loop())
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     _ = partial([torch.ones(1, 4), torch.ones(1, 4)])
        >>> [(p.label, p.call) for p in partial.fxdebug_partial.parts]
        [('', '(xs=list of 2 tensor(s))')]
    """
    if is_partial(model):
        return model
    if failure is not None:
        notes = [f"fx with symbolic arguments: {' '.join(str(failure).split())}", *notes]
    context = _Context(model, None, leaf_modules=leaf_modules, notes=notes)
    return context.build(model)


def instrument_parts(model: torch.nn.Module, instrument_graph: InstrumentGraph,
                     capture="modules", depth=None, include=None, exclude=None, grads=False,
                     mode="tensor", failure: TraceFailure | None = None) -> torch.nn.Module:
    """Instrument a model part by part: what :func:`fxdebug.instrument` does when the root fails.

    ``instrument_graph(part, arguments)`` instruments one traced part (the
    part's ``instrument()`` arguments, or None where the selection picks
    nothing in it); ``fxdebug.instrument`` passes its own pipeline. The other
    arguments are :func:`fxdebug.instrument`'s. Each part is traced and
    instrumented on its first call; eager modules' outputs are captured as
    they return. After the first run, patterns that matched no key raise
    :class:`~fxdebug.SelectionError` and a warning lists what ran eagerly.

    Example::

        >>> import torch, fxdebug, warnings
        >>> class Loop(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        ...     def forward(self, xs):
        ...         return [self.stem(x) for x in xs if x.sum() > 0]   # a branch on values
        >>> model = fxdebug.instrument(Loop())        # the root cannot be traced
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     _ = model([torch.ones(1, 4), torch.ones(2, 4)])
        >>> fxdebug.records(model).keys()
        ['stem.0', 'stem.1', 'stem', 'stem.0_1', 'stem.1_1', 'stem_1']
    """
    notes: Sequence[str] = ()
    if is_partial(model):
        previous = _context_of(model)
        model, notes = previous.source, previous.report.notes
    elif failure is not None:
        notes = [f"fx with symbolic arguments: {' '.join(str(failure).split())}"]
    selection = Selection(capture, depth, include, exclude, grads, mode)
    context = _Context(model, selection, instrument_graph, notes=notes)
    return context.build(model)


def traced_parts(model: torch.nn.Module) -> dict[str, fx.GraphModule]:
    """The parts a partial model has traced so far, by label (module path; ``path@1``... for
    a second specialisation of the same module), in the order they were first called.

    Each is an ordinary fxdebug GraphModule (``print(part.code)``,
    ``fxdebug.print_tabular(part)``, ``fxdebug.dump(part, *args, folder=folder)``).

    >>> import torch
    >>> traced_parts(torch.nn.Linear(2, 2))
    {}
    """
    if not is_partial(model):
        return {}
    return dict(_context_of(model).parts)


def part_inputs(model: torch.nn.Module, *inputs, **kwargs) -> dict[str, tuple]:
    """Run ``model(*inputs, **kwargs)`` and return the positional arguments of every part.

    ``{label: args}`` for the first call of each part in this run (tensors
    copied), so that ``part(*args)`` reruns it: compare it with the module it
    came from, or dump it::

        >>> import torch, fxdebug, warnings
        >>> class Loop(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem = torch.nn.Linear(4, 4)
        ...         self.head = torch.nn.Sequential(torch.nn.Linear(4, 2))
        ...     def forward(self, xs):
        ...         return [self.head(self.stem(x)) for x in xs if x.sum() > 0]
        >>> original = Loop()
        >>> model = fxdebug.instrument(original)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     args = part_inputs(model, [torch.ones(1, 4)])["head"]
        >>> fxdebug.check_equivalence(original.head, traced_parts(model)["head"], *args).ok
        True
    """
    context = _context_of(model)
    context.recording = {}
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
        return dict(context.recording)
    finally:
        context.recording = None
