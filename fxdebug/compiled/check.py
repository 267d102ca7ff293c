"""``check_compiled``: does ``torch.compile`` give what eager gives, and if not, which node differs?

Call tree::

    check_compiled(model, *inputs, backend="inductor")
      ├─ ControlledRuns                 same RNG state, buffers and fresh inputs every run
      ├─ eager run, compiled run        watched_runs.watched_run: torch.compile of fxdebug's
      │    │                            own entry point with the backend under test; the
      │    │                            user's compiled functions stay compiled (no reset)
      │    ├─ compare_values(outputs)   (+ parameter gradients with grads=True)
      │    └─ the graphs that ran       graph count, graph breaks: reason and user file:line
      └─ outputs differ: localize        localize.py
           ├─ capture_graphs             the graphs dynamo captured, keyed, and their inputs
           └─ localize(graph)            first divergent node by bisection over prefixes,
                                         then the smallest divergent piece (report.dump)
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch
from ..dumping import dump as dump_folder
from ..dumping.folder_runtime import flatten_outputs
from ..errors import FxdebugError
from ..runtime.values import outputs_loss
from ..tables.fit_to_width import fit_table, table_width
from ..runtime.formatting import format_error, format_location
from ..tables.report import Report
from ..tracing.keys import node_key, op_name
from ..tracing.locations import is_user_file
from ..equivalence.compare import Comparison, compare_values
from .instrumenting_backend import resolve_backend
from .localize import Localized, capture_graphs, localize
from .watched_runs import GraphRun, watched_run, watching
from ..equivalence.controlled_run import ControlledRuns

__all__ = ["check_compiled", "CompiledReport", "CompiledDivergence", "GraphBreak"]


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """Where dynamo stopped a graph: ``reason`` and the user's ``(file, line)``."""

    reason: str
    source: tuple[str, int] | None

    @property
    def location(self) -> str:
        """The user's ``file:line`` (``?`` when unknown)."""
        return format_location(self.source)


@dataclasses.dataclass(frozen=True)
class CompiledDivergence:
    """The first node whose compiled value differs from its eager value.

    ``key`` is fxdebug's key (module path + op), ``op`` what the node calls,
    ``source`` the user's ``(file, line)``, ``graph`` the index of the dynamo
    graph it lies in; ``piece`` the keys of the smallest piece of that graph
    that still differs when compiled alone (what :meth:`CompiledReport.dump`
    writes).
    """

    key: str
    op: str
    source: tuple[str, int] | None
    graph: int
    max_abs: float
    max_rel: float
    shape: str
    dtype: str
    piece: tuple[str, ...]
    compiles: int
    detail: str = ""

    @property
    def location(self) -> str:
        """The user's ``file:line`` of the node (``?`` when unknown)."""
        return format_location(self.source)

    def describe(self) -> str:
        """One line naming the node, its op, its source line and its error."""
        text = (f"{self.key} ({self.op}, {self.location}) in graph {self.graph}: max abs "
                f"{format_error(self.max_abs)}, max rel {format_error(self.max_rel)}")
        return text + (f"; {self.detail}" if self.detail else "")


@dataclasses.dataclass(repr=False)
class CompiledReport(Report):
    """What :func:`check_compiled` found.

    A :class:`~fxdebug.tables.report.Report`: ``str`` is :meth:`table`, ``repr``
    one line (``<CompiledReport 1 output(s), 1 graph(s), DIFFERENT: first divergence ...>``),
    ``to_dict()`` plain data.

    Attributes:
        ok: compiled outputs (and, with ``grads=True``, parameter gradients)
            agree with eager within tolerance.
        outputs / grads: one :class:`~fxdebug.equivalence.compare.Comparison` each.
        first_divergence: a :class:`CompiledDivergence`, or None.
        graph_breaks: :class:`GraphBreak` entries, in the order dynamo met them.
        graphs: how many graphs dynamo captured.
        notes: anything else worth knowing.
    """

    ok: bool
    outputs: list[Comparison]
    grads: list[Comparison]
    first_divergence: CompiledDivergence | None
    graph_breaks: list[GraphBreak]
    graphs: int
    backend: str
    mode: str | None
    rtol: float | None
    atol: float | None
    model_name: str
    notes: list[str] = dataclasses.field(default_factory=list)
    _found: Localized | None = dataclasses.field(default=None, repr=False)

    verdict_words = ("EQUIVALENT", "DIFFERENT")

    def _size(self) -> str:
        return (f"{len(self.outputs)} output(s), {self.graphs} graph(s), "
                f"{len(self.graph_breaks)} break(s)")

    def _finding(self) -> str:
        if self.first_divergence is not None:
            return f"first divergence {self.first_divergence.describe()}"
        failed = [c for c in self.outputs + self.grads if not c.ok]
        return f"{failed[0].path} differs (max abs {format_error(failed[0].max_abs)})" \
            if failed else ""

    def table(self, wide: bool | None = None) -> str:
        """Verdict, outputs, graph breaks, the first divergent node and its smallest piece.

        Fitted to the terminal unless ``wide=True`` (see :mod:`fxdebug.tables.fit_to_width`).
        """
        failed = [c for c in self.outputs if not c.ok]
        counts = f"{len(self.outputs) - len(failed)}/{len(self.outputs)} outputs agree"
        if self.grads:
            bad = sum(not c.ok for c in self.grads)
            counts += f", {len(self.grads) - bad}/{len(self.grads)} gradients agree"
        tol = ("dtype defaults of torch.testing.assert_close" if self.rtol is None and
               self.atol is None else f"rtol={self.rtol}, atol={self.atol}")
        lines = [f"check_compiled: {self.model_name}, eager vs torch.compile(backend="
                 f"{self.backend}{'' if self.mode is None else f', mode={self.mode!r}'})",
                 f"tolerance: {tol}",
                 f"verdict: {'EQUIVALENT' if self.ok else 'DIFFERENT'} ({counts})", ""]
        body = [[c.path, c.shape or "-", c.dtype or "-", format_error(c.max_abs),
                 format_error(c.max_rel), "ok" if c.ok else "DIFFERS", c.detail]
                for c in self.outputs + [c for c in self.grads if not c.ok]]
        lines.append(fit_table(body, ["value", "shape", "dtype", "max abs", "max rel", "verdict",
                                      "detail"], width=table_width(wide),
                               drop=("detail", "max rel"), truncate=("value", "detail")))
        lines += ["", f"graphs captured by dynamo: {self.graphs}, graph breaks: "
                      f"{len(self.graph_breaks)}"]
        if self.graph_breaks:
            lines.append(fit_table([[b.location, b.reason] for b in self.graph_breaks],
                                   ["source", "reason"], width=table_width(wide),
                                   truncate=("source", "reason")))
        first = self.first_divergence
        if first is not None:
            nodes = f"{len(first.piece)} node{'' if len(first.piece) == 1 else 's'}"
            lines += ["", f"first divergence: {first.describe()}",
                      f"smallest divergent piece ({nodes}, found with {first.compiles} "
                      f"compiles): {', '.join(first.piece)}",
                      "report.dump(folder) writes it; python folder/run.py shows the mismatch"]
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def dump(self, folder, overwrite: bool = False) -> str:
        """Write the smallest divergent piece as an :func:`fxdebug.dump` folder; return its path.

        ``expected.pt`` holds what the compiled piece gave; ``run.py`` runs the
        piece eagerly, so the difference it prints is the compiler's.
        """
        found, first = self._found, self.first_divergence
        if found is None or first is None:
            raise FxdebugError("nothing to dump: check_compiled found no divergent node "
                               f"({'the outputs agree' if self.ok else 'see the notes'}).")
        piece = found.piece
        path = dump_folder(piece.piece.gm, folder, *piece.piece.inputs, overwrite=overwrite)
        compiled = flatten_outputs(tuple(value.detach().clone() if isinstance(value, torch.Tensor)
                                         else value for value in piece.compiled))
        buffer = io.BytesIO()
        torch.save({"outputs": compiled, "grads": {}, "backward_error": "", "expect": "different",
                    "about": f"backend {self.backend!r} (expected.pt)"}, buffer)
        with open(os.path.join(path, "expected.pt"), "wb") as handle:
            handle.write(buffer.getvalue())
        with open(os.path.join(path, "README.md"), "a") as handle:
            handle.write(f"\n## Compiled divergence\n\nThis piece of dynamo graph {first.graph} "
                         f"computes `{first.key}` ({first.location}). `expected.pt` holds what "
                         f"backend `{self.backend}` gave for it; `run.py` runs it eagerly, so "
                         f"the difference it prints is the compiler's, and it says REPRODUCED "
                         f"(exit status 0) while there is one (max abs "
                         f"{format_error(first.max_abs)} when dumped).\n")
        return path


def _model_name(model) -> str:
    return type(model).__name__


def _backend_name(backend) -> str:
    if isinstance(backend, str):
        return backend
    return str(getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
               or type(backend).__name__)  # torch.compile's own wrappers carry compiler_name


def _param_grads(model: torch.nn.Module, output: Any) -> dict:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with torch.enable_grad():  # the caller may be under no_grad; grads=True asks for them
        loss = outputs_loss(output)  # the loss check_equivalence and find_nonfinite use
        if not named or loss is None:
            return {}
        found = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {name: grad for (name, _), grad in zip(named, found)}


def _graph_breaks(ran: list[GraphRun]) -> list[GraphBreak]:
    """The graph breaks behind the graphs a compiled run ran: reason and the user's line."""
    breaks: list[GraphBreak] = []
    for graph in ran:
        if graph.reason is None:
            continue
        reason, stack = graph.reason
        lines = [line.strip() for line in reason.splitlines() if line.strip()]
        text = lines[0] if lines else "unknown"
        explanation = next((line for line in lines if line.startswith("Explanation:")), "")
        if explanation:
            text = f"{text}: {explanation[len('Explanation:'):].strip()}"
        source = None
        for frame in stack:
            if is_user_file(frame.filename) and frame.lineno is not None:
                source = (frame.filename, frame.lineno)
        entry = GraphBreak(text, source)
        if entry not in breaks:
            breaks.append(entry)
    return breaks


def _backend_key(backend, mode):
    return backend if callable(backend) else (backend, mode)


def check_compiled(model: torch.nn.Module, *inputs, backend="inductor", mode: str | None = None,
                   rtol: float | None = None, atol: float | None = None,
                   grads: bool = False) -> CompiledReport:
    """Compare ``torch.compile(model, backend=backend, mode=mode)`` with eager, node by node.

    Both run on copies of ``inputs`` from the same RNG state and buffers, in
    the modes the model is in. Outputs (and, with ``grads=True``, parameter
    gradients of ``sum(out.sum())``) are compared as ``torch.testing.
    assert_close`` would. When they differ, each graph dynamo captured is
    compiled piece by piece with the same backend on the eager values of its
    inputs, and compared with fxdebug's eager captures of the same nodes: the
    first node that differs is named by key and the user's ``file:line``.
    Dynamo's caches are never reset: functions you compiled before stay
    compiled, and a cache entry another backend compiled is never used for
    this check (dynamo guards entries by backend). Each check compiles its own
    entry point; frames inside the model that dynamo compiles on their own
    (after a graph break) keep one entry for this backend, reused by the next
    check (see :mod:`fxdebug.compiled.watched_runs`).

    Args:
        backend: a dynamo backend name or your own ``(gm, example_inputs) ->
            callable``.
        mode: inductor's mode (``"max-autotune"``...), inductor only.

    Example::

        >>> import torch, fxdebug
        >>> def bad_backend(gm, example_inputs):      # computes sigmoid for every relu
        ...     for node in gm.graph.nodes:
        ...         if node.target in (torch.relu, torch.nn.functional.relu):
        ...             node.target, node.kwargs = torch.sigmoid, {}
        ...     gm.recompile()
        ...     return gm.forward
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
        ...                             torch.nn.Linear(4, 2))
        >>> report = fxdebug.check_compiled(model, torch.randn(3, 4), backend=bad_backend)
        >>> report.ok, report.first_divergence.key, report.first_divergence.piece
        (False, '1', ('1',))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check_compiled expects an nn.Module, got {type(model).__name__}.")
    if not inputs:
        raise FxdebugError("check_compiled needs example inputs: check_compiled(model, x).")
    compile_piece = resolve_backend(backend, mode)
    notes: list[str] = []
    found: Localized | None = None
    with ControlledRuns([model], inputs, train=None) as runs:
        eager_out = runs.run(model, grad=grads)
        eager_grads = _param_grads(model, eager_out) if grads else {}
        try:
            compiled_out, ran = watched_run(model, runs, watching(_backend_key(backend, mode),
                                                                  compile_piece), grad=grads)
            compiled_grads = _param_grads(model, compiled_out) if grads else {}
        except Exception as exc:
            exc.add_note(f"fxdebug.check_compiled: raised while running torch.compile(model, "
                         f"backend={_backend_name(backend)!r}); the eager model ran fine")
            raise
        outputs = compare_values(eager_out, compiled_out, "out", rtol, atol)
        grad_rows = []
        for name, ref in eager_grads.items():
            got = compiled_grads.get(name)
            if ref is not None and got is not None:
                grad_rows.extend(compare_values(ref, got, f"grad/{name}", rtol, atol))
            elif (ref is None) != (got is None):
                grad_rows.append(Comparison(f"grad/{name}", False, float("inf"), float("inf"),
                                            detail="a gradient reaches it on one side only"))
        outputs_ok = all(c.ok for c in outputs)
        ok = outputs_ok and all(c.ok for c in grad_rows)
        breaks, graph_count = _graph_breaks(ran), len(ran)
        if not outputs_ok:
            graphs = capture_graphs(model, runs)
            for graph in graphs:
                found = localize(graph, compile_piece, rtol, atol)
                if found is not None:
                    break
            if found is None:
                notes.append("every dynamo graph, compiled alone on its eager inputs, agrees "
                             "with eager: the difference builds up across graphs or lies in "
                             "the eager code between them")
        elif not ok:
            notes.append("outputs agree but parameter gradients differ: the backward is not "
                         "localized by node (compare fxdebug.check_equivalence with grads=True)")
    divergence = None
    if found is not None:
        piece_gm = found.piece.piece.gm
        piece_keys = tuple(node_key(n) for n in piece_gm.graph.nodes
                           if n.op in ("call_function", "call_method", "call_module"))
        c = found.comparison
        divergence = CompiledDivergence(
            key=node_key(found.node), op=op_name(found.node, found.graph.gm),
            source=found.node.meta.get("fxdebug_source"), graph=found.graph.index,
            max_abs=c.max_abs, max_rel=c.max_rel, shape=c.shape, dtype=c.dtype,
            piece=piece_keys, compiles=found.compiles, detail=c.detail)
    return CompiledReport(ok=ok, outputs=outputs, grads=grad_rows, first_divergence=divergence,
                          graph_breaks=breaks, graphs=graph_count,
                          backend=_backend_name(backend), mode=mode, rtol=rtol, atol=atol,
                          model_name=_model_name(model), notes=notes, _found=found)
