"""The report of a step ``watch_nonfinite`` flagged: the replay, and what to do when it differs.

``NonfiniteWatch.check`` flags a step on its own values (the outputs' sum, max|g|)
and replays it node by node (``find_nonfinite``). A :class:`WatchReport` is that
replay's :class:`~fxdebug.NonfiniteReport` with the step and what was flagged::

    replay found the node      the report reads as find_nonfinite's (NON-FINITE, the node)
    replay finite              NOT REPRODUCED, first in the verdict, repr and table:
      ├─ a torch.compile'd model: the eager replay cannot show what the compiled code
      │    made; check_compiled on the step's inputs (same RNG state and buffers)
      │    names the first node where the compiled code differs, with file:line
      └─ otherwise: what the replay does not restore (nondeterministic kernels, state
           outside parameters, buffers, RNG and inputs, a loss the replay lacks)

>>> report = WatchReport(forward=None, backward=None, later_forward=[], later_backward=[],
...                      parameter_grads=[], backward_ran=True, model_name="Net",
...                      inputs="4x2 float32", mode="train", loss="sum(out.sum())",
...                      step=3, flagged="outputs NaN", flagged_detail="outputs: 2 NaN of 8")
>>> report
<WatchReport Net, NOT REPRODUCED: step 3 flagged (outputs NaN), eager replay finite>
>>> print(report.table().splitlines()[0])
NOT REPRODUCED: step 3 was flagged (outputs NaN) but the eager replay is finite
>>> report.ok, report.reproduced
(False, False)
"""

from __future__ import annotations

import dataclasses

from ..base.report import Report
from .nonfinite import NonfiniteReport

__all__ = ["WatchReport"]


@dataclasses.dataclass(repr=False)
class WatchReport(NonfiniteReport):
    """:class:`~fxdebug.NonfiniteReport` of a watched step's replay, with what the watch flagged.

    ``step``: the watch's step count; ``flagged``: what was non-finite in the step
    (``"outputs NaN"``), ``flagged_detail`` with counts and parameter names.
    ``reproduced``: the replay found non-finite values; when it did not, ``ok`` is
    False all the same and the verdict is ``NOT REPRODUCED``. ``compiled``: for a
    ``torch.compile``'d model, :func:`fxdebug.check_compiled`'s report on the
    step's inputs (``compiled.first_divergence`` names the node), run with
    ``compiled_backend``; ``compiled_error`` when that check raised.
    """

    step: int = 0
    flagged: str = ""
    flagged_detail: str = ""
    compiled: Report | None = None
    compiled_backend: str = ""
    compiled_error: str = ""

    def _found(self) -> bool:
        return (self.forward is not None or self.backward is not None
                or bool(self.parameter_grads))

    @property
    def reproduced(self) -> bool:
        """The replay found non-finite values (or nothing was flagged)."""
        return not self.flagged or self._found()

    @property
    def ok(self) -> bool:
        return not self.flagged and not self._found()

    @property
    def verdict_words(self) -> tuple[str, str]:  # type: ignore[override]
        return ("all finite", "NON-FINITE" if self.reproduced else "NOT REPRODUCED")

    def _not_reproduced(self) -> str:
        return (f"step {self.step} was flagged ({self.flagged}) but the eager replay is "
                f"finite")

    def _compiled_finding(self) -> str:
        """What check_compiled said, in a few words (``""`` when it did not run)."""
        found = self.compiled
        if self.compiled_error:
            return f"check_compiled on the step's inputs failed: {self.compiled_error}"
        if found is None:
            return ""
        divergence = getattr(found, "first_divergence", None)
        if divergence is not None:
            return (f"the compiled code differs from eager first at {divergence.key} "
                    f"({divergence.op}, {divergence.location})")
        if found.verdict():
            return "the compiled model agrees with eager on the step's inputs"
        return f"the compiled model differs from eager: {found._finding()}"

    def _finding(self) -> str:
        if self.reproduced:
            return super()._finding()
        divergence = getattr(self.compiled, "first_divergence", None)
        compiled = (f"compiled code first differs at {divergence.key} ({divergence.location})"
                    if divergence is not None else self._compiled_finding())
        first = self.flagged.split(", ")[0]  # short: the repr is one line
        return (f"step {self.step} flagged ({first}), eager replay finite"
                + (f"; {compiled}" if compiled else ""))

    def _advice(self) -> list[str]:
        if self.compiled_backend:
            found = self.compiled
            divergence = getattr(found, "first_divergence", None)
            if divergence is not None:
                return [f"what to do: the compiled code made them, your eager model does not: "
                        f"{divergence.key} at {divergence.location} is where the compiled "
                        f"values first depart from eager (the compiler orders and fuses "
                        f"floating-point operations its own way); make that computation "
                        f"robust to rounding, or keep it eager (torch.compiler.disable); "
                        f"report.compiled.dump(folder) writes the smallest piece that shows it"]
            if found is not None and not found.verdict():
                return ["what to do: the compiled model's outputs differ from eager on these "
                        "inputs but no single dynamo graph does alone (see the notes of "
                        "report.compiled); compare graph by graph with "
                        "torch.compile(model, backend=fxdebug.backend(inner=...))"]
            if found is None and not self.compiled_error:
                return ["what to do: run fxdebug.check_compiled(model, *inputs) on the step's "
                        "inputs (watch.inputs()): it names the first node where the compiled "
                        "code differs from eager"]
            if found is None:
                return ["what to do: fix the error above, or compare the compiled graphs with "
                        "torch.compile(model, backend=fxdebug.backend(inner=...))"]
        lines = ["what to do: the flagged values depend on something the replay does not "
                 "restore: a nondeterministic kernel (torch.use_deterministic_algorithms(True) "
                 "makes runs repeatable), state outside the parameters, buffers, RNG state and "
                 "inputs (an attribute or global the forward reads, changed since), or "
                 "another thread writing the model; fxdebug.find_nonfinite(model, *inputs) "
                 "on watch.inputs() replays the step again"]
        if "outputs" not in self.flagged and self.loss == "sum(out.sum())":
            lines.append("  only parameter gradients were flagged and the replay "
                         "differentiated sum(out.sum()): pass the step's loss, "
                         "watch.check(loss=lambda out: criterion(out, y))")
        return lines

    def table(self, wide: bool | None = None, floatfmt: str = ".4g") -> str:
        """find_nonfinite's table; when the replay is finite, NOT REPRODUCED first, the
        compiled check, what to do, then the replay."""
        if self.reproduced:
            return super().table(wide, floatfmt)
        lines = [f"NOT REPRODUCED: {self._not_reproduced()}",
                 f"  flagged: {self.flagged_detail or self.flagged}"]
        if self.compiled_backend:
            lines.append(f"compiled model (torch.compile, backend {self.compiled_backend}): "
                         f"the eager replay cannot show what the compiled code computed; "
                         f"fxdebug.check_compiled on the step's inputs, RNG state and buffers:")
            finding = self._compiled_finding()
            if finding:
                lines.append(f"  {finding}")
            if self.compiled is not None:
                lines.extend("  | " + line for line in self.compiled.table(wide).splitlines())
        lines.extend(self._advice())
        lines.append(f"eager replay of step {self.step}, node by node:")
        lines.extend("  " + line for line in self._lines(wide, floatfmt))
        lines.append(f"verdict: NOT REPRODUCED (step {self.step} flagged, eager replay finite"
                     + (f"; {self._compiled_finding()})" if self._compiled_finding() else ")"))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)
