"""Partial instrumentation: models whose root cannot be traced, traced part by part.

A detector's ``forward`` iterates over a list of images; RAFT compares input
shapes; transformers check their keyword arguments: fx cannot trace these
roots with symbolic arguments, even with auto-leaf. fxdebug then keeps the
model as a tree of *dispatchers* and traces each module when it is first
called, specialised to the call::

    instrument(model)                          trace(model) raised TraceFailure
      └─ _build(model)                         a copy of every module (parameters and
           │                                   buffers shared); each one's forward is a
           │                                   _Dispatch
           └─ model_copy(*inputs)
                └─ _Dispatch(module, path)(*args, **kwargs)
                     ├─ signature: training flags, the structure of the arguments,
                     │  the value of every non-tensor (None, flags, sizes)
                     ├─ first call with it: fxdebug.trace(module, concrete_args=...)
                     │    ├─ works: a *part*: GraphModule with full-path keys
                     │    │  ("backbone.body.layer1.0.conv1"), instrumented like instrument()
                     │    │  does, auto-leaves calling their own dispatchers
                     │    └─ TraceFailure: *eager*: the reason is kept
                     ├─ part: run the graph
                     └─ eager: run the module's own forward (its children dispatch
                        again) and capture its output

Tensors become graph inputs (also inside lists and dicts: ``fx.PH``); every
other argument is fixed, so ``token_type_ids=None`` or ``targets=None`` take
the branch they take eagerly, and a call with other values (or after
``model.train()``) gets a part of its own. A module whose arguments fxdebug
cannot specialise on (an ``ImageList``, ``*args``) runs eagerly, and says so.

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

import dataclasses
import enum
import functools
import inspect
import re
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.node import has_side_effect

from . import runtime
from .errors import SelectionError, TraceFailure
from .keys import META_KEY, META_MODULE, META_RETURNS, join_path, key_base, prefix_keys
from .locations import caller_stacklevel
from .passes._recorder import RECORDER_ATTR
from .records import Records
from .selection import _as_patterns, _check_patterns, candidates, key_depth, matches
from .tracing import ModuleReturn, module_tree_copy, shallow_module_copy, trace

__all__ = ["PartialReport", "TracedPart", "EagerModule", "SharedRecorder", "PartRecorder",
           "begin_part", "trace_parts", "instrument_parts", "is_partial", "traced_parts",
           "part_inputs", "REPORT_ATTR"]

REPORT_ATTR = "fxdebug_partial"


# -- the report --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TracedPart:
    """A traced part: its label (``path``, ``path@1`` for a second specialisation), path,
    class, the call it is specialised to, and the modules it keeps as auto-leaves."""

    label: str
    path: str
    module_type: str
    call: str
    auto_leaves: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class EagerModule:
    """A module whose ``forward`` ran eagerly, with the explanation of why."""

    path: str
    module_type: str
    kind: str
    location: str | None
    reason: str

    @classmethod
    def from_failure(cls, path: str, module: torch.nn.Module, failure: TraceFailure):
        """Keep ``failure``'s explanation, naming modules by their path in the whole model."""
        text = " ".join(str(failure).split())
        if path:
            inner = failure.module_path
            if inner:
                text = text.replace(f"module {inner!r}", f"module {join_path(path, inner)!r}")
            else:
                text = text.replace(f"the root module ({failure.module_type})",
                                    f"module {path!r} ({failure.module_type})", 1)
        return cls(path, type(module).__name__, failure.kind, failure.location, text)


@dataclasses.dataclass
class PartialReport:
    """What a partially traced model traced, what ran eagerly and why; filled as it runs.

    ``parts``: :class:`TracedPart` in the order they were first called;
    ``eager``: :class:`EagerModule` (path ``""`` is the root); ``notes``: why
    whole-model front ends were not used.

    >>> import torch, fxdebug, warnings
    >>> class Twice(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return self.fc(x) if x.sum() > 0 else -x    # a branch on values
    >>> model = fxdebug.instrument(Twice())
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     _ = model(torch.ones(1, 2))
    >>> print(model.fxdebug_partial.summary().splitlines()[0])
    Twice: partially traced, 0 traced part(s), 1 module(s) eager
    >>> model.fxdebug_partial.eager[0].kind
    'control flow on a traced value'
    """

    model_type: str
    parts: list[TracedPart] = dataclasses.field(default_factory=list)
    eager: list[EagerModule] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """What was traced and what ran eagerly, one line each (byte-identical across runs)."""
        lines = [f"{self.model_type}: partially traced, {len(self.parts)} traced part(s), "
                 f"{len(self.eager)} module(s) eager"]
        lines.extend(f"  note: {note}" for note in self.notes)
        if not self.parts and not self.eager:
            lines.append("  (parts are traced on the first run: run the model once)")
        lines.append("traced parts (GraphModules; keys are full module paths):")
        for part in self.parts:
            leaves = f"; auto-leaves: {', '.join(part.auto_leaves)}" if part.auto_leaves else ""
            lines.append(f"  {part.label or '(root)'} ({part.module_type}) {part.call}{leaves}")
        lines.append("eager modules (run as Python; their outputs are captured):")
        for eager in self.eager:
            lines.append(f"  {eager.path or '(root)'} ({eager.module_type}): {eager.reason}")
        return "\n".join(lines)

    def warning_text(self) -> str:
        eager = "; ".join(f"{e.path or '(root)'} ({e.module_type}): {e.kind}"
                          f"{' at ' + e.location if e.location else ''}" for e in self.eager)
        parts = ", ".join(part.label or "(root)" for part in self.parts) or "none"
        return (f"fxdebug could not trace {self.model_type} as a whole: it traced "
                f"{len(self.parts)} part(s) ({parts}) and ran {len(self.eager)} module(s) "
                f"eagerly, capturing their outputs: {eager}. "
                f"print(model.{REPORT_ATTR}.summary()) gives each reason in full.")


def is_partial(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a partially traced (or instrumented) model made by fxdebug.

    >>> import torch
    >>> is_partial(torch.nn.Linear(2, 2))
    False
    """
    return isinstance(module.__dict__.get(REPORT_ATTR), PartialReport)


# -- the recorders -----------------------------------------------------------------------
class SharedRecorder(runtime.Recorder):
    """The one Recorder of a partially instrumented model (its ``fxdebug_recorder``).

    Counts the calls of each part and eager module within the current
    Records, so repeated calls get keys ``path_1``, ``path_2``...; ``depth``
    is how many dispatched module calls are running (0: none, so the next one
    starts a new Records).

    >>> shared = SharedRecorder()
    >>> [shared.next_call("head.conv") for _ in range(3)]
    [0, 1, 2]
    """

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self._calls: dict[str, int] = {}
        self._calls_of: Records | None = None

    def next_call(self, name: str) -> int:
        """How many times ``name`` was called before in the current Records (and count this one)."""
        if self._calls_of is not self.latest:
            self._calls, self._calls_of = {}, self.latest
        count = self._calls.get(name, 0)
        self._calls[name] = count + 1
        return count

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.update(depth=0, _calls={}, _calls_of=None)
        return state


class _PartRecords:
    """What a part's capture nodes write to: the shared Records, keys renamed for call n."""

    __slots__ = ("records", "part", "call", "_grads")

    def __init__(self, records: Records, part: "PartRecorder", call: int, grads: bool = False):
        self.records, self.part, self.call, self._grads = records, part, call, grads

    def add(self, key: str, op: str, value: Any, **kwargs) -> None:
        target = self.records.grads if self._grads else self.records
        target.add(self.part.rename(key, self.call), op, value, **kwargs)

    @property
    def grads(self) -> "_PartRecords":
        return _PartRecords(self.records, self.part, self.call, grads=True)


class PartRecorder(runtime.Recorder):
    """The ``fxdebug_recorder`` of one traced part: files captures in the shared Recorder.

    A part's keys are baked into its graph as full module paths; on the n-th
    call of the part in a run (n > 0) each key ``base`` / ``base_j`` becomes
    ``base_{n*m+j}`` (``m``: calls of ``base`` in one call of the part), the
    name a forward hook counting calls would give it.

    >>> shared = SharedRecorder()
    >>> part = PartRecorder(shared, "head.conv", {"head.conv.0": ("head.conv.0", 0, 1)})
    >>> part.rename("head.conv.0/1", 0), part.rename("head.conv.0/1", 2)
    ('head.conv.0/1', 'head.conv.0_2/1')
    """

    def __init__(self, shared: SharedRecorder, path: str, plan: dict | None = None) -> None:
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "shared", shared)  # not a submodule: the root owns it
        self.path = path
        self.plan = dict(plan or {})
        self.call = 0

    @property
    def latest(self) -> _PartRecords:
        return _PartRecords(self.shared.latest, self, self.call)

    def begin_call(self) -> None:
        """A new call of this part: start a run when nothing else did, then count the call."""
        if self.shared.depth == 0:
            runtime.begin_run(self.shared, ())
        self.call = self.shared.next_call(self.path)

    def rename(self, key: str, call: int) -> str:
        if call == 0:
            return key
        head, sep, rest = key.partition("/")
        base, local, per_call = self.plan.get(head, (head, 0, 1))
        index = call * per_call + local
        return f"{base if index == 0 else f'{base}_{index}'}{sep}{rest}"

    def extra_repr(self) -> str:
        return f"part={self.path!r}"

    def __getstate__(self):
        state = dict(self.__dict__)
        state["call"] = 0
        return state


@has_side_effect
def begin_part(recorder: runtime.Recorder, inputs: tuple):
    """First node of an instrumented part: count this call of the part (a plain Recorder: begin_run)."""
    emitted = runtime._emit_if_tracing(begin_part, (recorder, inputs), {})
    if emitted is not None:
        return emitted
    if isinstance(recorder, PartRecorder):
        recorder.begin_call()
    else:
        runtime.begin_run(recorder, inputs)
    return None


# -- specialising a call -----------------------------------------------------------------
_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                   torch.layout, torch.memory_format, type(Ellipsis), slice, enum.Enum)


def _is_constant(value) -> bool:
    return isinstance(value, _CONSTANT_TYPES) and not isinstance(value, torch.Tensor)


@functools.lru_cache(maxsize=None)
def _forward_signature(cls) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    leaves, _ = pytree.tree_flatten(value)
    tensors = sum(isinstance(leaf, torch.Tensor) for leaf in leaves)
    if tensors:
        return f"{type(value).__name__} of {tensors} tensor(s)"
    text = repr(value)
    return text if len(text) <= 40 and " at 0x" not in text else type(value).__name__


@dataclasses.dataclass
class _CallPlan:
    """How to trace and call a module for one call: or why it cannot be."""

    signature: tuple = ()
    positional: list = dataclasses.field(default_factory=list)
    concrete_args: dict = dataclasses.field(default_factory=dict)
    description: str = ""
    reason: str = ""


def _call_plan(module: torch.nn.Module, args: tuple, kwargs: dict) -> _CallPlan:
    """Bind a call to ``forward``'s parameters; tensors stay inputs, the rest is fixed."""
    signature = _forward_signature(type(module))
    if signature is None:
        return _CallPlan(reason="its forward has no inspectable signature")
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError as exc:
        return _CallPlan(reason=f"the call does not match forward's signature ({exc})")
    names, values, described = [], [], []
    plan = _CallPlan()
    for index, (name, parameter) in enumerate(signature.parameters.items()):
        if index == 0:
            continue  # self
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            if bound.arguments.get(name):
                return _CallPlan(reason=f"it is called with extra arguments through "
                                        f"{'*' if parameter.kind == parameter.VAR_POSITIONAL else '**'}"
                                        f"{name}, which tracing cannot fix")
            continue
        value = bound.arguments.get(name, parameter.default)
        if value is inspect.Parameter.empty:
            return _CallPlan(reason=f"argument {name!r} is missing")
        names.append(name)
        values.append(value)
        if isinstance(value, torch.Tensor):
            described.append(name)
            continue
        leaves, spec = pytree.tree_flatten(value)
        odd = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)
               and not _is_constant(leaf)]
        if odd:
            return _CallPlan(reason=f"argument {name!r} holds a value of type {type(odd[0]).__name__}, which "
                                    f"is neither a tensor, a container of tensors nor a constant")
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            plan.concrete_args[name] = pytree.tree_unflatten(
                [fx.PH if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
        else:
            plan.concrete_args[name] = value
        described.append(f"{name}={_describe(value)}")
    leaves, spec = pytree.tree_flatten(values)
    marks = tuple(("tensor",) if isinstance(leaf, torch.Tensor) else (type(leaf), leaf)
                  for leaf in leaves)
    plan.signature = (tuple(m.training for m in module.modules()), spec, marks)
    plan.positional = values
    plan.description = f"({', '.join(described)})"
    return plan


def _strip_guards(gm: fx.GraphModule) -> None:
    """Drop the asserts fx adds for fixed arguments: the dispatcher checks them on every call."""
    from torch.fx._symbolic_trace import _assert_is_none
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if node.target is _assert_is_none or node.target is torch._assert:
            inputs = node.all_input_nodes
            gm.graph.erase_node(node)
            for arg in inputs:
                if arg.op == "call_function" and not arg.users:
                    gm.graph.erase_node(arg)


def _output_items(value, prefix: str = "") -> list[tuple[str, fx.Node]]:
    if isinstance(value, fx.Node):
        return [(prefix, value)]
    join = (lambda name: f"{prefix}/{name}") if prefix else str
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        pairs = zip(value._fields, value)
    elif isinstance(value, (tuple, list)):
        pairs = enumerate(value)
    elif isinstance(value, dict):
        pairs = value.items()
    else:
        return []
    found = []
    for name, item in pairs:
        found.extend(_output_items(item, join(name)))
    return found


def _note_part_output(gm: fx.GraphModule, path: str, module_type: str) -> None:
    """Record the part's own output as a module output keyed ``path`` (as in a full trace)."""
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    value = output.args[0] if output.args else None
    out_spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
    if out_spec is not None:  # arguments given as pytrees: the graph returns flat outputs
        value = pytree.tree_unflatten(list(value), out_spec)
    items = _output_items(value)
    if not items:
        return
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    anchor = max((node for _, node in items), key=order.__getitem__)
    record = ModuleReturn(path, module_type, tuple((sub, node.name) for sub, node in items), None)
    anchor.meta.setdefault(META_RETURNS, []).append(record)


def _set_submodule(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[name] = module


def _clean_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a dispatch subtree with the dispatchers taken out: what tracing sees."""
    clean = module_tree_copy(module)
    for sub in clean.modules():
        sub.__dict__.pop("forward", None)
        sub.__dict__.pop(REPORT_ATTR, None)
        if isinstance(sub._modules.get(RECORDER_ATTR), SharedRecorder):
            del sub._modules[RECORDER_ATTR]
    return clean


_LEAF_TRACER: fx.Tracer | None = None


def _is_fx_leaf(module: torch.nn.Module) -> bool:
    global _LEAF_TRACER
    if _LEAF_TRACER is None:
        _LEAF_TRACER = fx.Tracer()
    return _LEAF_TRACER.is_leaf_module(module, "")


def _is_container(module: torch.nn.Module) -> bool:
    """ModuleList, ModuleDict and other modules without a forward of their own."""
    return getattr(type(module).forward, "__name__", "") == "_forward_unimplemented"


# -- the dispatchers -----------------------------------------------------------------------
class _Dispatch:
    """The ``forward`` of one module of a partial model: a traced part, or eager and captured."""

    def __init__(self, context: "_Context", module: torch.nn.Module, path: str,
                 traceable: bool) -> None:
        self.context, self.module, self.path, self.traceable = context, module, path, traceable
        self.variants: list[tuple[tuple, fx.GraphModule | None]] = []  # None: eager

    def __call__(self, *args, **kwargs):
        context = self.context
        shared = context.shared
        outermost = shared.depth == 0
        if outermost:
            runtime.begin_run(shared, ())
        shared.depth += 1
        try:
            part, positional = self._choose(args, kwargs)
            if part is not None:
                context.note_inputs(part, positional)
                output = part(*positional)
            else:
                output = type(self.module).forward(self.module, *args, **kwargs)
                context.capture_eager(self, output)
        finally:
            shared.depth -= 1
        if outermost:
            context.after_run()
        return output

    def _choose(self, args, kwargs):
        if not self.traceable:
            return None, None
        plan = _call_plan(self.module, args, kwargs)
        if plan.reason:
            self.context.eager(self, None, plan.reason)
            return None, None
        for signature, part in self.variants:
            if signature == plan.signature:
                return part, plan.positional
        part = self.context.specialise(self, plan)
        self.variants.append((plan.signature, part))
        return part, plan.positional


class _Context:
    """What the dispatchers of one partial model share."""

    def __init__(self, source: torch.nn.Module, selection: "_Selection | None", passes=(),
                 leaf_modules=(), notes=()) -> None:
        self.source = source
        self.selection, self.passes = selection, list(passes)
        self.report = PartialReport(type(source).__name__, notes=list(notes))
        self.shared = SharedRecorder()
        self.module_paths = dict.fromkeys(name for name, _ in
                                          source.named_modules(remove_duplicate=False))
        self.leaf_paths = [leaf for leaf in leaf_modules if isinstance(leaf, str)]
        self.leaf_types = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type))
        self.parts: dict[str, fx.GraphModule] = {}
        self.seen_keys: dict[str, None] = {}
        self._eager_seen: dict[tuple[str, str], None] = {}
        self.recording: dict[str, tuple] | None = None
        self.runs = 0

    # -- building ------------------------------------------------------------------------
    def build(self, model: torch.nn.Module) -> torch.nn.Module:
        memo: dict[int, torch.nn.Module] = {}

        def copy_tree(module: torch.nn.Module, path: str) -> torch.nn.Module:
            if id(module) in memo:
                return memo[id(module)]
            new = memo[id(module)] = shallow_module_copy(module)
            for name, child in module._modules.items():
                if child is not None:
                    new._modules[name] = copy_tree(child, join_path(path, name))
            if not _is_container(module):
                leaf = (path in self.leaf_paths or isinstance(module, self.leaf_types)
                        or _is_fx_leaf(module))
                new.__dict__["forward"] = _Dispatch(self, new, path, traceable=not leaf)
            return new

        root = copy_tree(model, "")
        root.__dict__[REPORT_ATTR] = self.report
        if self.selection is not None:
            root._modules[RECORDER_ATTR] = self.shared
        return root

    # -- tracing a part --------------------------------------------------------------------
    def specialise(self, dispatch: _Dispatch, plan: _CallPlan) -> fx.GraphModule | None:
        path, module = dispatch.path, dispatch.module
        inside = [leaf[len(path) + 1:] if path else leaf for leaf in self.leaf_paths
                  if not path or leaf.startswith(path + ".")]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # auto-leaves go into the report instead
                gm = trace(_clean_tree(module), leaf_modules=[*inside, *self.leaf_types],
                           concrete_args=plan.concrete_args)
        except TraceFailure as failure:
            self.eager(dispatch, failure, "")
            return None
        _strip_guards(gm)
        prefix_keys(gm.graph, path)
        if path:
            _note_part_output(gm, path, type(module).__name__)
        auto = [(join_path(path, rel), rel) for rel, _ in gm.meta.get("fxdebug_auto_leaves", ())]
        gm.meta["fxdebug_auto_leaves"] = [(join_path(path, rel), reason) for rel, reason in
                                          gm.meta.get("fxdebug_auto_leaves", ())]
        for _, rel in auto:
            _set_submodule(gm, rel, module.get_submodule(rel))  # calls its own dispatcher
        label = path if path not in self.parts else \
            f"{path}@{sum(p.path == path for p in self.report.parts)}"
        gm.meta.update(fxdebug_part=label, fxdebug_frontend="fx")
        gm = self._instrument(gm, label)
        self.parts[label] = gm
        self.report.parts.append(TracedPart(label, path, type(module).__name__,
                                            plan.description, tuple(full for full, _ in auto)))
        return gm

    def _instrument(self, gm: fx.GraphModule, label: str) -> fx.GraphModule:
        from .instrument import build_pipeline, run_pipeline
        self.seen_keys.update(dict.fromkeys(t.key for t in candidates(gm, every_node=True)))
        if self.selection is None:
            gm.recompile()
            return gm
        arguments = self.selection.for_part([t.key for t in candidates(gm, every_node=True)])
        if arguments is None and not self.passes:
            gm.recompile()
            return gm
        recorder = PartRecorder(self.shared, gm.meta["fxdebug_part"].partition("@")[0])
        gm.add_submodule(RECORDER_ATTR, recorder)
        pipeline = build_pipeline(**arguments) if arguments is not None else []
        gm = run_pipeline(gm, pipeline + [_as_pass(p) for p in self.passes])
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is runtime.begin_run:
                node.target = begin_part
                node.meta[META_KEY] = "begin_part"
        if any(node.op == "get_attr" and node.target == RECORDER_ATTR for node in gm.graph.nodes):
            recorder.plan = _key_plan(gm, self.module_paths)
        else:
            delattr(gm, RECORDER_ATTR)
        gm.recompile()
        return gm

    # -- running ---------------------------------------------------------------------------
    def eager(self, dispatch: _Dispatch, failure: TraceFailure | None, reason: str) -> None:
        module, path = dispatch.module, dispatch.path
        if failure is not None:
            entry = EagerModule.from_failure(path, module, failure)
        else:
            entry = EagerModule(path, type(module).__name__, reason.split(",")[0], None,
                                f"module {path or '(root)'!r} ({type(module).__name__}) runs "
                                f"eagerly: {reason}.")
        if (path, entry.reason) not in self._eager_seen:
            self._eager_seen[(path, entry.reason)] = None
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
        if capture == "stats":
            runtime.capture_stats(self.shared, output, key, op)
        elif capture == "tensor":
            # eager code may write to the output in place later: keep a copy
            runtime.capture(self.shared, output, key, op, clone=True)
        if grads is not None:
            runtime.record_grads(self.shared, output, key, op, stats_only=grads == "stats")

    def note_inputs(self, part: fx.GraphModule, positional: list) -> None:
        if self.recording is not None:
            label = part.meta["fxdebug_part"]
            if label not in self.recording:
                from ._controlled_run import clone_inputs
                self.recording[label] = tuple(clone_inputs(list(positional)))

    def after_run(self) -> None:
        self.runs += 1
        if self.runs != 1:
            return
        if self.selection is not None:
            self.selection.check(list(self.seen_keys))
        if self.report.eager:
            warnings.warn(self.report.warning_text(), stacklevel=caller_stacklevel())


def _as_pass(p):
    from .passes.base import as_pass
    return as_pass(p)


# -- selection -------------------------------------------------------------------------
def _key_plan(gm: fx.GraphModule, module_paths: dict) -> dict[str, tuple[str, int, int]]:
    """For every capturable key: (base, index among the keys of that base, keys of that base)."""
    bases: dict[str, str] = {}
    for target in candidates(gm, every_node=True):
        key = target.key
        if target.is_module:
            match = re.fullmatch(r"(.+)_(\d+)", key)
            base = key if key in module_paths or not match or \
                match.group(1) not in module_paths else match.group(1)
        else:
            node = target.nodes[0]
            base = key if node.op == "placeholder" else \
                key_base(node.op, node.target, node.meta.get(META_MODULE, ""))
            if not (key == base or re.fullmatch(re.escape(base) + r"_\d+", key)):
                base = key
        bases.setdefault(key, base)
    per_base: dict[str, int] = {}
    plan = {}
    for key, base in bases.items():
        plan[key] = (base, per_base.get(base, 0))
        per_base[base] = per_base.get(base, 0) + 1
    return {key: (base, index, per_base[base]) for key, (base, index) in plan.items()}


class _Selection:
    """The user's capture arguments, checked against the whole model, applied per part."""

    def __init__(self, capture, depth, include, exclude, grads, mode) -> None:
        if isinstance(capture, str) and capture not in ("modules", "all"):
            raise SelectionError(f"capture={capture!r}: use 'modules', 'all', or a list of keys "
                                 f"or globs such as ['backbone.body.layer1', '*.conv1'].")
        if mode not in ("tensor", "stats"):
            raise SelectionError(f"mode={mode!r}: use 'tensor' (keep values) or 'stats' (keep "
                                 f"summary statistics only).")
        self.capture = capture if isinstance(capture, str) else _as_patterns("capture", capture)
        self.depth, self.grads, self.mode = depth, grads, mode
        self.include = _as_patterns("include", include)
        self.exclude = _as_patterns("exclude", exclude)
        self.include_given = include is not None

    def check(self, keys: list[str]) -> None:
        pool = [_Key(key) for key in keys]
        if isinstance(self.capture, list):
            _check_patterns("capture", self.capture, pool)
        _check_patterns("include", self.include, pool)
        _check_patterns("exclude", self.exclude, pool)

    def for_part(self, keys: list[str]) -> dict | None:
        """``instrument()`` arguments for a part with these keys; None: nothing to do there."""
        def here(patterns):
            return [p for p in patterns if any(matches(key, p) for key in keys)]
        include = here(self.include)
        if self.include_given and not include:
            return None
        capture = self.capture if isinstance(self.capture, str) else here(self.capture)
        if isinstance(self.capture, list) and self.capture and not capture:
            return None
        return dict(capture=capture, depth=self.depth, include=include or None,
                    exclude=here(self.exclude) or None, grads=self.grads, mode=self.mode)

    def for_eager(self, key: str) -> tuple[str | None, str | None]:
        """(capture mode or None, grads mode or None) for the output of a module run eagerly."""
        if self.depth is not None and key_depth(key) > self.depth:
            return None, None
        if self.include and not any(matches(key, p) for p in self.include):
            return None, None
        if any(matches(key, p) for p in self.exclude):
            return None, None
        listed = isinstance(self.capture, list)
        chosen = not listed or any(matches(key, p) for p in self.capture)
        capture = self.mode if chosen and not (listed and not self.capture) else None
        grads_chosen = chosen or (listed and not self.capture)
        return capture, (self.mode if self.grads and grads_chosen else None)


@dataclasses.dataclass(frozen=True)
class _Key:
    key: str


# -- entry points ------------------------------------------------------------------------
def _context_of(model: torch.nn.Module) -> _Context:
    dispatch = model.__dict__.get("forward")
    if not isinstance(dispatch, _Dispatch):
        raise TypeError(f"{type(model).__name__} is not a partially traced model made by fxdebug.")
    return dispatch.context


def trace_parts(model: torch.nn.Module, failure: TraceFailure | None = None, leaf_modules=(),
                notes=()) -> torch.nn.Module:
    """A copy of ``model`` that traces each module when it is first called; the rest runs eagerly.

    What ``fxdebug.trace(model, frontend="auto")`` returns when neither fx nor
    export can trace the whole model. Pass it to :func:`fxdebug.instrument`.

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
        >>> partial = trace_parts(Loop())
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


def instrument_parts(model: torch.nn.Module, capture="modules", depth=None, include=None,
                     exclude=None, grads=False, mode="tensor", passes=(),
                     failure: TraceFailure | None = None) -> torch.nn.Module:
    """Instrument a model part by part: what :func:`fxdebug.instrument` does when the root fails.

    Arguments as :func:`fxdebug.instrument`. Each part is traced and
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
    notes = ()
    if is_partial(model):
        previous = _context_of(model)
        model, notes = previous.source, previous.report.notes
    elif failure is not None:
        notes = [f"fx with symbolic arguments: {' '.join(str(failure).split())}"]
    selection = _Selection(capture, depth, include, exclude, grads, mode)
    context = _Context(model, selection, passes, notes=notes)
    return context.build(model)


def traced_parts(model: torch.nn.Module) -> dict[str, fx.GraphModule]:
    """The parts a partial model has traced so far, by label (module path; ``path@1``... for
    a second specialisation of the same module), in the order they were first called.

    Each is an ordinary fxdebug GraphModule (``print(part.code)``,
    ``fxdebug.print_tabular(part)``, ``fxdebug.dump(part, folder, *args)``).

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
