"""DriftReport: the keys whose statistics moved most over a window of logged steps.

A key's drift is the factor between the last and the first value of its stat in the
window (``rms`` by default: a growing activation or weight); keys are ordered by how far
that factor is from 1 either way (``|log factor|``), then by key, so the table is the
same on every run. A series that turns non-finite, or leaves or reaches zero, moves
infinitely far and comes first.

>>> rows = drift_rows({("fc1", "out"): [(0, 1.0), (9, 1.1)], ("fc2", "param"): [(0, 1.0), (9, 30.0)]}, None)
>>> [(r.key, r.kind, r.factor) for r in rows]
[('fc2', 'param', 30.0), ('fc1', 'out', 1.1)]
"""

from __future__ import annotations

import dataclasses
import math

from ..base.fit_to_width import fit_table, table_width
from ..base.report import Report

__all__ = ["DriftReport", "DriftRow", "drift_rows"]


@dataclasses.dataclass(frozen=True)
class DriftRow:
    """One key's drift: its stat at the first and last step of the window."""

    key: str
    kind: str
    first_step: int
    last_step: int
    first: float
    last: float
    factor: float
    score: float


def _score(first: float, last: float) -> tuple[float, float]:
    """``(factor, |log factor|)``; infinite where the series turned non-finite or crossed 0."""
    if not (math.isfinite(first) and math.isfinite(last)):
        return math.nan, math.inf
    if first == last:
        return 1.0, 0.0
    if first == 0 or last == 0 or (first < 0) != (last < 0):
        return (last / first if first else math.inf), math.inf
    factor = last / first
    return factor, abs(math.log(factor))


def drift_rows(series: dict[tuple[str, str], list[tuple[int, float]]],
               limit: int | None) -> list[DriftRow]:
    """The rows of a drift table, most moved first, at most ``limit`` (None: all)."""
    rows = []
    for (key, kind), points in series.items():
        if len(points) < 2:
            continue
        (first_step, first), (last_step, last) = points[0], points[-1]
        factor, score = _score(first, last)
        rows.append(DriftRow(key, kind, first_step, last_step, first, last, factor, score))
    rows.sort(key=lambda r: (-r.score, r.key, r.kind))
    return rows if limit is None else rows[:limit]


@dataclasses.dataclass(repr=False)
class DriftReport(Report):
    """The keys that moved most in a window of a monitor's series (``series.drift()``).

    ``rows`` (:class:`DriftRow`), most moved first; ``steps`` the window's first and last
    logged step; ``stat`` the statistic compared; ``rank`` None for the global batch.
    """

    folder: str
    stat: str
    rank: int | None
    steps: tuple[int, int]
    rows: list[DriftRow]

    def table(self, wide: bool | None = None) -> str:
        """Key, kind, the stat at the window's ends, and the factor, most moved first."""
        whose = "global batch" if self.rank is None else f"rank {self.rank}"
        head = (f"drift of {self.stat}, steps {self.steps[0]}-{self.steps[1]} ({whose}), "
                f"most moved first")
        if not self.rows:
            return head + "\nno key has two logged steps in the window"
        cells = [[r.key, r.kind, f"{r.first:.4g}", f"{r.last:.4g}", f"x{r.factor:.3g}"]
                 for r in self.rows]
        table = fit_table(cells, ["key", "kind", f"{self.stat} first", f"{self.stat} last",
                                  "factor"], width=table_width(wide), truncate=("key",),
                          drop=("kind",))
        return f"{head}\n{table}"

    def _size(self) -> str:
        return f"{len(self.rows)} keys, steps {self.steps[0]}-{self.steps[1]}"

    def _finding(self) -> str:
        if not self.rows:
            return ""
        top = self.rows[0]
        return f"most moved {top.key} {top.kind} {self.stat} x{top.factor:.3g}"
