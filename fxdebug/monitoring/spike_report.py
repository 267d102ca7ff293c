"""SpikeReport: what the replay of a spike step found, on which rank, and what moved before it.

``mon.step(loss)`` returns one when a rule of ``monitor(spikes=...)`` fired::

    spike at step 37: loss 412.3 > 10x the window max 2.1 (steps seen: 36)
    reproduced: yes (the replay's outputs and parameter gradients equal the step's)
    first non-finite: none
    first divergence from float64: blocks.3.attn.softmax (forward, 2.1e+05 eps, rank 0)
    moved most in the logged steps before (rms): blocks.3.attn.qk x41.2, ...

``reproduced`` False is a finding of its own: the same batch, parameters and random state
give another result (a transient fault, a race, a non-deterministic kernel), as in
Megatron's rerun of a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..base.report import Report

__all__ = ["SpikeReport"]


@dataclasses.dataclass(repr=False)
class SpikeReport(Report):
    """The replay of one spike step (see :func:`fxdebug.monitor`'s ``spikes=``).

    Attributes:
        step: the monitor's step.
        trigger: why the step is a spike (the rule's words).
        reproduced: whether the replay gave the step's outputs and gradients (None: not
            replayed, see ``notes``).
        first_nonfinite: the first node holding NaN/Inf (forward, else backward), or None;
            ``first_nonfinite_where`` says which pass.
        first_divergence: the first node whose error against a float64 replay exceeds the
            rounding budget, or None (``compared`` False: not compared, see ``notes``).
        rank: the rank holding the finding (the lowest), 0 in a single process.
        moved: ``(series name, first, last, factor)`` of the keys that moved most in the
            logged steps before the spike.
    """

    step: int
    trigger: str
    reproduced: bool | None
    reproduced_why: str
    first_nonfinite: str | None
    first_nonfinite_where: str
    first_divergence: str | None
    divergence_eps: float
    compared: bool
    rank: int
    moved: list[tuple[str, float, float, float]]
    notes: list[str]
    per_rank: list[dict] = dataclasses.field(default_factory=list)

    verdict_words = ("REPRODUCED", "NOT REPRODUCED")

    @property
    def ok(self) -> bool | None:
        """True when the replay reproduced the spike (None when there was no replay)."""
        return self.reproduced

    def _where(self) -> str:
        return f", rank {self.rank}" if self.per_rank else ""

    def table(self, wide: bool | None = None) -> str:
        answer = {True: "yes", False: "NO", None: "not replayed"}[self.reproduced]
        lines = [f"spike at step {self.step}: {self.trigger}",
                 f"reproduced: {answer} ({self.reproduced_why})" if self.reproduced_why
                 else f"reproduced: {answer}"]
        if self.first_nonfinite is None:
            lines.append("first non-finite: none")
        else:
            lines.append(f"first non-finite: {self.first_nonfinite} ({self.first_nonfinite_where}"
                         f"{self._where()})")
        if not self.compared:
            lines.append("first divergence from float64: not compared")
        elif self.first_divergence is None:
            lines.append("first divergence from float64: none (every node within rounding)")
        else:
            lines.append(f"first divergence from float64: {self.first_divergence} "
                         f"({self.divergence_eps:.3g} eps{self._where()})")
        if self.moved:
            text = ", ".join(f"{name} x{factor:.3g}" for name, _, _, factor in self.moved[:5])
            lines.append(f"moved most in the logged steps before: {text}")
        lines.extend(f"note: {note}" for note in self.notes)
        for entry in self.per_rank:
            if entry.get("differs"):
                lines.append(f"rank {entry['rank']}: {entry['differs']}")
        return "\n".join(lines)

    def _size(self) -> str:
        return f"step {self.step}"

    def _finding(self) -> str:
        if self.first_divergence is not None:
            return f"first divergence {self.first_divergence}"
        if self.first_nonfinite is not None:
            return f"first non-finite {self.first_nonfinite}"
        return self.trigger

    def record(self) -> dict[str, Any]:
        """The line written to the series folder's ``spikes.jsonl``."""
        return {"step": self.step, "trigger": self.trigger, "reproduced": self.reproduced,
                "first_divergence": self.first_divergence,
                "first_nonfinite": self.first_nonfinite, "rank": self.rank,
                "text": self.table(wide=True)}
