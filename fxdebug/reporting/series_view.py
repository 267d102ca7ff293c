"""SeriesView: what a picture of values over training steps shows, as plain data.

The PNG (:func:`fxdebug.reporting.plots.view_figure`) and the HTML section
(:func:`fxdebug.reporting.series_html.series_html`) draw the same view, so the
two agree; :meth:`fxdebug.monitoring.Series.chart_data` makes one from a
monitor's folder::

    SeriesView(title, charts=(Chart(title, ylabel, lines=(Line(label, steps, values), ...)),
                              ...),
               marks=(Mark(step, label), ...),        spike steps, on every chart
               tables=(Table(caption, head, rows), ...),
               details=((summary, text), ...), notes=(...))

>>> chart = Chart("rms", "rms", (Line("fc.out.rms", (0, 5), (1.0, 30.0)),))
>>> chart.log, chart.steps()
(True, [0, 5])
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["SeriesView", "Chart", "Line", "Mark", "Table", "LOG_SPAN"]

LOG_SPAN = 10.0
"""A chart whose values are all positive and span at least this factor is drawn on a log scale."""


@dataclasses.dataclass(frozen=True)
class Line:
    """One series: ``values[i]`` at ``steps[i]`` (NaN or Inf where it was not finite)."""

    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]

    def finite(self) -> list[float]:
        """The finite values."""
        return [v for v in self.values if math.isfinite(v)]


@dataclasses.dataclass(frozen=True)
class Chart:
    """Lines sharing one y axis."""

    title: str
    ylabel: str
    lines: tuple[Line, ...]

    @property
    def log(self) -> bool:
        """Log scale: every finite value is positive and they span at least a factor of
        :data:`LOG_SPAN` (a narrower range reads better on a linear scale)."""
        finite = [v for line in self.lines for v in line.finite()]
        return bool(finite) and min(finite) > 0 and max(finite) >= LOG_SPAN * min(finite)

    def steps(self) -> list[int]:
        """Every step of every line, sorted."""
        return sorted(dict.fromkeys(step for line in self.lines for step in line.steps))


@dataclasses.dataclass(frozen=True)
class Mark:
    """A step marked on every chart (a vertical line) with a short label."""

    step: int
    label: str


@dataclasses.dataclass(frozen=True)
class Table:
    """A table of text cells."""

    caption: str
    head: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class SeriesView:
    """Charts over steps, the steps marked on them, tables and long texts below."""

    title: str
    charts: tuple[Chart, ...]
    marks: tuple[Mark, ...] = ()
    tables: tuple[Table, ...] = ()
    details: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
