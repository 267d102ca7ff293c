"""``fxdebug.backend``: a dynamo backend that records what a compiled model computes, by key.

Call tree::

    torch.compile(model, backend=fxdebug.backend(inner="inductor"))
      └─ dynamo captures a graph ─> InstrumentingBackend(gm, example_inputs)
           ├─ key_dynamo_graph(gm)          keys = module paths, user file:line
           ├─ keyed_copy + Capture(...)      the capture nodes fxdebug would insert
           ├─ capture nodes -> extra outputs the values they capture leave the graph
           │                                 (copied where a later in-place op writes)
           └─ inner backend(graph with extra outputs)
    compiled(x)
      └─ each graph call: compiled code, then its extra outputs go to the Records
    fxdebug.records(be)                      the Records of the latest forward

The inner backend compiles the captured values as outputs, so the records
hold the values the *compiled* code computed (not an eager re-run). A
forward is one run: a run starts when a graph of the outermost frame dynamo
compiled is called; graphs called again within a run (a block with a graph
break, reused) record under ``key_1``, ``key_2`` as forward hooks name a
module's later calls.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..errors import FxdebugError, deprecated
from ..passes import Capture
from ..runtime import RECORDER_ATTR, Recorder, Records
from ..base.torch_compat import dynamo_frame_id, inductor_backend, lookup_backend
from ..tracing import keyed_copy
from ..tracing.keys import META_PASS
from .dynamo_graphs import key_dynamo_graph

__all__ = ["backend", "InstrumentingBackend", "resolve_backend"]


def resolve_backend(inner, mode: str | None = None):
    """A dynamo backend callable for a name (``"inductor"``, ``"aot_eager"``) or a callable."""
    if callable(inner):
        if mode is not None:
            raise FxdebugError(f"mode={mode!r} applies to the inductor backend only; a backend "
                               f"function receives no mode. Drop mode= or use inductor.")
        return inner
    if not isinstance(inner, str):
        raise TypeError(f"backend must be a dynamo backend name or a function (gm, "
                        f"example_inputs) -> callable, got {type(inner).__name__}.")
    if mode is not None:
        if inner != "inductor":
            raise FxdebugError(f"mode={mode!r} applies to the inductor backend only, not "
                               f"{inner!r}. Drop mode= or use backend='inductor'.")
        return inductor_backend(mode)
    try:
        return lookup_backend(inner)
    except Exception as exc:  # dynamo's InvalidBackend: say which names exist
        names = ", ".join(torch.compiler.list_backends(exclude_tags=()))
        raise FxdebugError(f"backend {inner!r} is not a registered dynamo backend; known: "
                           f"{names}. Or pass your own function (gm, example_inputs) -> "
                           f"callable.") from exc


@dataclasses.dataclass(frozen=True)
class _Capture:
    key: str
    op: str
    stats_only: bool


class InstrumentingBackend:
    """What :func:`backend` returns: pass it to ``torch.compile(..., backend=...)``.

    ``fxdebug.records(be)`` gives the Records of the latest forward; ``be.graphs`` the instrumented graphs handed to the inner
    backend, in the order dynamo compiled them.
    """

    def __init__(self, inner, capture, depth, include, exclude, mode) -> None:
        self.inner = resolve_backend(inner)
        self.capture = Capture(capture, depth=depth, include=include, exclude=exclude,
                               mode=mode)
        self.graphs: list[fx.GraphModule] = []
        setattr(self, RECORDER_ATTR, Recorder())
        self._first_frame: int | None = None
        self._seen: dict[str, int] = {}

    def records(self) -> Records:
        """Deprecated: ``fxdebug.records(be)``, as for an instrumented module."""
        deprecated("backend.records()", "fxdebug.records(backend)")
        return getattr(self, RECORDER_ATTR).latest

    def __call__(self, gm: fx.GraphModule, example_inputs):
        frame = dynamo_frame_id(gm)
        if frame is not None and (self._first_frame is None or frame < self._first_frame):
            self._first_frame = frame
        instrumented, captures, outputs = self._instrument(gm)
        self.graphs.append(instrumented)
        compiled = self.inner(instrumented, example_inputs)

        def run(*args):
            out = compiled(*args)
            values = list(out)
            self._record(frame is None or frame == self._first_frame, captures,
                         values[outputs:])
            kept = values[:outputs]
            return tuple(kept) if isinstance(out, tuple) else kept
        return run

    def _instrument(self, gm: fx.GraphModule):
        key_dynamo_graph(gm)
        copy = keyed_copy(gm)
        self.capture(copy)
        graph = copy.graph
        output = next(node for node in graph.nodes if node.op == "output")
        returned = output.args[0]
        if not isinstance(returned, (tuple, list)):
            raise FxdebugError("fxdebug.backend: dynamo handed over a graph whose output is "
                               "not a tuple; this torch version is not supported yet.")
        captures: list[_Capture] = []
        extra: list[fx.Node] = []
        for node in list(graph.nodes):
            if node.meta.get(META_PASS) != "capture" or node.op != "call_function":
                continue
            if node.target.__name__ not in ("capture", "capture_stats"):
                continue
            _, value, key, op = node.args
            if not isinstance(value, fx.Node):
                graph.erase_node(node)
                continue
            with graph.inserting_before(node):  # always a copy: compiled buffers may be reused
                kept = graph.call_function(torch.clone, (value,))
            extra.append(kept)
            captures.append(_Capture(key, op, node.target.__name__ == "capture_stats"))
            graph.erase_node(node)
        for node in reversed(list(graph.nodes)):
            if node.meta.get(META_PASS) == "capture" and not node.users:
                graph.erase_node(node)  # begin_run, then the recorder's get_attr
        if hasattr(copy, RECORDER_ATTR):
            delattr(copy, RECORDER_ATTR)
        output.args = (type(returned)(list(returned) + extra),)
        graph.lint()
        copy.recompile()
        return copy, captures, len(returned)

    def _record(self, new_run: bool, captures, values) -> None:
        recorder = getattr(self, RECORDER_ATTR)
        if new_run:
            recorder.latest = Records()
            self._seen = {}
        for capture, value in zip(captures, values):
            count = self._seen.get(capture.key, 0)
            self._seen[capture.key] = count + 1
            key = capture.key if count == 0 else f"{capture.key}_{count}"
            recorder.latest.add(key, capture.op, value, stats_only=capture.stats_only)


def backend(inner="inductor", capture="modules", depth: int | None = None, include=None,
            exclude=None, mode: str = "tensor") -> InstrumentingBackend:
    """A dynamo backend that records each compiled graph's values by key, then runs ``inner``.

    Args:
        inner: the backend that compiles the graphs: a name (``"inductor"``,
            ``"aot_eager"``, ``"eager"``) or a function ``(gm, example_inputs)
            -> callable``.
        capture, depth, include, exclude, mode: what to record, as in
            :func:`fxdebug.instrument` (keys are module paths, ``"modules"``
            records module outputs as forward hooks see them).

    Returns:
        An :class:`InstrumentingBackend`; after ``compiled(x)``,
        ``fxdebug.records(be)`` holds the values the compiled code computed.

    Example::

        >>> import torch, fxdebug
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
        >>> be = fxdebug.backend(inner="eager")
        >>> _ = torch.compile(model, backend=be)(torch.ones(1, 2))
        >>> fxdebug.records(be).keys(), fxdebug.records(be)["0"].shape
        (['0', '1'], torch.Size([1, 3]))
    """
    return InstrumentingBackend(inner, capture, depth, include, exclude, mode)

