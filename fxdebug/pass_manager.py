"""PassManager: run passes one by one, snapshot, diff and check each.

Call tree::

    PassManager(passes, check_inputs=(x,)).run(model)
      ├─ trace(model)                      unless it is a GraphModule (then a keyed copy)
      ├─ snapshot "input"                  code + node table
      └─ passes.base.run_passes(gm, passes, after_each=record_stage)   the one pass runner
           ├─ pass.apply(gm); graph.lint()  an fxdebug Pass, a torch PassBase, or a
           │                               function gm -> PassResult | gm | None
           └─ record_stage
                ├─ snapshot, diff(previous, now)      the code as the graph generates it
                └─ with check_inputs: recompile, check_equivalence(previous stage, now)
      └─ recompile()                       once, unless the checks did already
    -> PassManagerResult(graph_module, modified, report): as torch's PassManager returns a
       PassResult; the PassReport holds one Stage per snapshot (the input, then one per pass)

A pass that changes nothing gives a warning (a pass written for plain torch.fx
may look for ``operator.add`` where fxdebug keeps a ``+=`` whose write can matter
as ``operator.iadd``).
A pass that raises stops the run with its own exception, plus the runner's note
naming the pass, the passes before it, and the node key and user file:line where
known (:func:`fxdebug.passes.base.pass_failure_note`); a pass that changes what the
module computes stops it with :class:`~fxdebug.errors.PassEquivalenceError` naming the
first divergent node.
Either way the exception's ``report`` keeps every snapshot taken so far.
Progress goes to the ``fxdebug`` logger at INFO level.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Sequence

import torch
import torch.fx as fx

from .equivalence.equivalence import EquivalenceReport, check_equivalence
from .errors import FidelityWarning, PassEquivalenceError, deprecated
from .passes.base import Pass, PassResult, as_pass, run_passes, unchanged_message
from .reporting.graph_diff import GraphDiff, GraphSnapshot, diff, snapshot
from .base.fit_to_width import fit_table, table_width
from .base.report import Report
from .tracing import keyed_copy
from .frontend import trace
from .tracing.locations import caller_stacklevel

__all__ = ["PassManager", "PassManagerResult", "PassReport", "Stage"]

log = logging.getLogger("fxdebug")


@dataclasses.dataclass(frozen=True)
class Stage:
    """The graph after one pass (or the input): snapshot, diff from before, verdict."""

    name: str
    snapshot: GraphSnapshot
    modified: bool
    diff: GraphDiff | None
    equivalence: EquivalenceReport | None  # when check_inputs were given

    def __repr__(self) -> str:
        """One line: the pass, whether it changed the graph, its diff and verdict in short."""
        parts = [repr(self.name), "modified" if self.modified else "unchanged",
                 f"{len(self.snapshot.views)} nodes"]
        if self.diff is not None:
            parts.append(self.diff.summary())
        verdict = getattr(self.equivalence, "ok", None)
        if verdict is not None:
            parts.append("EQUIVALENT" if verdict else "DIFFERENT")
        return f"<Stage {', '.join(parts)}>"


@dataclasses.dataclass(repr=False)
class PassReport(Report):
    """Every stage of a run, in order: ``stages[0]`` is the input graph.

    ``ok``: every checked stage was equivalent to the one before (None: no checks ran).
    """

    verdict_words = ("EQUIVALENT", "DIFFERENT")

    stages: list[Stage]

    @property
    def snapshots(self) -> list[GraphSnapshot]:
        return [stage.snapshot for stage in self.stages]

    @property
    def ok(self) -> bool | None:
        checked = [stage.equivalence for stage in self.stages[1:] if stage.equivalence is not None]
        return all(report.ok for report in checked) if checked else None

    def _size(self) -> str:
        return f"{len(self.stages) - 1} pass(es)"

    def _finding(self) -> str:
        for stage in self.stages[1:]:
            if stage.equivalence is not None and not stage.equivalence.ok:
                first = stage.equivalence.first_divergence
                if first is None:
                    return f"pass {stage.name!r} changed the outputs"
                how = f": its arguments changed {first.arguments}" if first.arguments else ""
                return f"pass {stage.name!r} changed the outputs; first divergence {first.key}{how}"
        return ""

    def _fields(self) -> dict:
        return {"stages": [{"pass": stage.name, "modified": stage.modified,
                            "diff": stage.diff, "equivalence": stage.equivalence}
                           for stage in self.stages[1:]]}

    def table(self, wide: bool | None = None) -> str:
        """One row per pass: modified, node changes, equivalence verdict."""
        rows = []
        for stage in self.stages[1:]:
            verdict = "-"
            if stage.equivalence is not None:
                verdict = "ok" if stage.equivalence.ok else "DIFFERS"
            rows.append([stage.name, "yes" if stage.modified else "no",
                         stage.diff.summary() if stage.diff is not None else "-", verdict])
        return fit_table(rows, ["pass", "modified", "nodes +/-/~", "equivalent"],
                         width=table_width(wide), truncate=("pass",))


@dataclasses.dataclass(frozen=True)
class PassManagerResult:
    """What :meth:`PassManager.run` returns, as torch's ``PassManager`` returns a
    ``PassResult``: ``graph_module``, ``modified`` (some pass changed the graph) and
    ``report`` (the :class:`PassReport`). Unpacking it as ``gm, report`` is deprecated.
    """

    graph_module: fx.GraphModule
    modified: bool
    report: PassReport

    def __iter__(self):
        deprecated("gm, report = PassManager(...).run(model)",
                   "result = PassManager(...).run(model) with result.graph_module and "
                   "result.report")
        return iter((self.graph_module, self.report))


class PassManager:
    """Run ``passes`` in order with a snapshot, a diff and (optionally) a check after each.

    Args:
        passes: ``fxdebug.passes.Pass`` objects, any torch ``PassBase``, or functions
            ``gm -> PassResult | gm | None``.
        check_inputs: inputs for an equivalence check of every stage against
            the one before; ``None`` skips the checks.
        rtol, atol: tolerances for the checks (dtype defaults when ``None``).

    Example::

        >>> import torch, fxdebug
        >>> pm = fxdebug.PassManager([fxdebug.passes.Capture(), fxdebug.passes.GradHooks()],
        ...                          check_inputs=(torch.randn(2, 3),))
        >>> result = pm.run(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
        >>> result.modified, isinstance(result.graph_module, torch.fx.GraphModule)
        (True, True)
        >>> print(result.report.table())
        pass     modified    nodes +/-/~    equivalent
        -------  ----------  -------------  ------------
        capture  yes         +4 -0 ~0       ok
        grads    yes         +3 -0 ~1       ok
    """

    def __init__(self, passes: Sequence, check_inputs=None, rtol: float | None = None,
                 atol: float | None = None) -> None:
        self.passes = [as_pass(p) for p in passes]
        if check_inputs is not None and not isinstance(check_inputs, tuple):
            check_inputs = (check_inputs,)
        self.check_inputs = check_inputs
        self.rtol, self.atol = rtol, atol

    def __repr__(self) -> str:
        names = ", ".join(step.name for step in self.passes)
        checked = "checked" if self.check_inputs is not None else "unchecked"
        return f"<PassManager {len(self.passes)} pass(es), {checked}: {names}>"

    def run(self, model: torch.nn.Module) -> PassManagerResult:
        """Trace ``model`` (or copy a GraphModule) and run every pass on it."""
        gm = keyed_copy(model) if isinstance(model, fx.GraphModule) else trace(model)
        inputs = self.check_inputs or ()
        report = PassReport([Stage("input", snapshot(gm, "input", *inputs), False, None, None)])
        checking = self.check_inputs is not None
        previous = [copy.deepcopy(gm)] if checking else []  # the stage before, for the check

        def record_stage(step: Pass, result: PassResult) -> None:
            stage_gm = result.graph_module
            if checking:
                stage_gm.recompile()  # the check runs this stage
            now = snapshot(stage_gm, step.name, *inputs)
            verdict = None
            if previous:
                verdict = check_equivalence(previous[0], stage_gm, *inputs, rtol=self.rtol,
                                            atol=self.atol)
                if len(report.stages) < len(self.passes):
                    previous[0] = copy.deepcopy(stage_gm)
            change = diff(report.stages[-1].snapshot, now)
            if not change and change.before_code == change.after_code:
                warnings.warn(unchanged_message(step.name, stage_gm), FidelityWarning,
                              stacklevel=caller_stacklevel())
            earlier = [stage.name for stage in report.stages[1:]]
            report.stages.append(Stage(step.name, now, result.modified, change, verdict))
            log.info("pass %s: modified=%s nodes %s%s", step.name, result.modified,
                     change.summary(), "" if verdict is None else f" equivalent={verdict.ok}")
            if verdict is not None and not verdict.ok:
                first = verdict.first_divergence
                where = (f"; first divergent node: {first.describe()}" if first is not None
                         else "; the outputs differ (no node-level divergence was found)")
                before = f"after {', '.join(map(repr, earlier))}" if earlier else "as the first pass"
                raise PassEquivalenceError(
                    f"pass {step.name!r} ({before}) changed what the module computes"
                    f"{where}. Fix the pass, or loosen rtol/atol if the change is rounding. "
                    f"report.stages[-1].equivalence.table() shows every node.",
                    pass_name=step.name, report=report)

        try:
            gm = run_passes(gm, self.passes, after_each=record_stage).graph_module
        except Exception as exc:
            setattr(exc, "report", report)  # any exception: the snapshots taken so far
            raise
        if not checking and self.passes:
            gm.recompile()
        return PassManagerResult(gm, any(stage.modified for stage in report.stages[1:]), report)
