"""A SeriesView as HTML: inline SVG line charts with the marked steps, and tables.

No script and no network: each chart is an ``<svg>`` of ``<polyline>`` s (one per
series, ``data-label`` naming it; a non-finite value breaks the line), a dashed red
``<line class="mark" data-step=...>`` per marked step, and below it the plotted values
in a ``<table class="fxdebug-series-values">`` (inside ``<details>``). Every label is
escaped.

>>> from fxdebug.reporting.series_view import Chart, Line, Mark, SeriesView
>>> view = SeriesView("run", (Chart("rms", "rms", (Line("fc<1>", (0, 5, 10), (1.0, 2.0, 8.0)),)),),
...                   marks=(Mark(5, "spike 5"),))
>>> text = series_html(view)
>>> text.count("<polyline"), 'data-step="5"' in text, "fc&lt;1&gt;" in text
(1, True, True)
"""

from __future__ import annotations

import html
import math

from .series_view import Chart, Mark, SeriesView

__all__ = ["series_html", "line_chart_svg"]

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#d62728")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 230, 64, 16, 24, 38


def _esc(value) -> str:
    return html.escape(str(value))


def _ticks(low: float, high: float, log: bool) -> list[tuple[float, str]]:
    """``(value, text)`` of the y ticks in ``[low, high]``: 1, 2, 5 times a power of ten
    (only the powers where that gives more than 8) on a log scale, 5 even steps on a linear one."""
    if not log:
        return [(v, format(v, ".3g")) for v in (low + (high - low) * i / 4 for i in range(5))]
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    ticks = [(m * 10.0 ** d, f"{m}e{d}") for d in range(first, last + 1) for m in (1, 2, 5)
             if low <= m * 10.0 ** d <= high]
    if len(ticks) > 8:
        ticks = [(v, t) for v, t in ticks if t.startswith("1e")]
        while len(ticks) > 8:
            ticks = ticks[::2]
    return ticks


def _y_range(chart: Chart) -> tuple[float, float]:
    finite = [v for line in chart.lines for v in line.finite()]
    low, high = min(finite), max(finite)
    if chart.log:
        span = math.log10(high) - math.log10(low)
        pad = 0.05 * span if span > 0 else 0.5
        return low / 10 ** pad, high * 10 ** pad
    pad = 0.05 * (high - low) if high > low else abs(low) * 0.1 or 1.0
    return low - pad, high + pad


def line_chart_svg(chart: Chart, marks: tuple[Mark, ...] = ()) -> str:
    """One chart as an inline ``<svg>``: its lines over steps, log scale when
    :attr:`Chart.log`, a dashed red vertical line and label per mark.

    >>> from fxdebug.reporting.series_view import Chart, Line
    >>> svg = line_chart_svg(Chart("t", "y", (Line("a", (0, 1), (1.0, 10.0)),)))
    >>> svg.startswith("<svg"), ">1e0<" in svg, ">5e0<" in svg, ">1e1<" in svg
    (True, True, True, True)
    """
    if not any(line.finite() for line in chart.lines):
        return f"<p>{_esc(chart.title)}: no finite values to draw.</p>"
    steps = chart.steps() + [mark.step for mark in marks]
    first, last = min(steps), max(steps)
    low, high = _y_range(chart)
    scale = math.log10 if chart.log else (lambda v: v)
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: int) -> float:
        return LEFT + (width / 2 if last == first else (step - first) / (last - first) * width)

    def y(value: float) -> float:
        return TOP + (1 - (scale(value) - scale(low)) / (scale(high) - scale(low))) * height

    parts = [f'<svg class="fxdebug-series-chart" width="{WIDTH}" height="{HEIGHT}" '
             f'role="img" aria-label="{_esc(chart.title)}" data-log="{int(chart.log)}">'
             f'<text x="{LEFT}" y="14">{_esc(chart.title)}'
             f'{" (log scale)" if chart.log else ""}</text>']
    for tick, text in _ticks(low, high, chart.log):
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + width}" y1="{y(tick):.1f}" '
                     f'y2="{y(tick):.1f}" stroke="#ddd"/><text x="2" y="{y(tick) + 3:.1f}">'
                     f'{text}</text>')
    span = max(1, last - first)
    stride = next(m * 10 ** e for e in range(19) for m in (1, 2, 5) if span <= 8 * m * 10 ** e)
    for step in range(first - first % stride, last + 1, stride):
        if step >= first:
            parts.append(f'<text x="{x(step):.1f}" y="{HEIGHT - 22}" text-anchor="middle">'
                         f'{step}</text>')
    parts.append(f'<text x="{LEFT + width / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">'
                 f'step</text>')
    for index, line in enumerate(chart.lines):
        colour = COLOURS[index % len(COLOURS)]
        segments: list[list[str]] = [[]]
        for step, value in zip(line.steps, line.values):
            if math.isfinite(value) and (value > 0 or not chart.log):
                segments[-1].append(f"{x(step):.2f},{y(value):.2f}")
            elif segments[-1]:
                segments.append([])
        for points in segments:
            if points:
                parts.append(f'<polyline data-label="{_esc(line.label)}" fill="none" '
                             f'stroke="{colour}" stroke-width="1.5" points="{" ".join(points)}">'
                             f'<title>{_esc(line.label)}</title></polyline>')
    for mark in marks:
        parts.append(f'<line class="mark" data-step="{mark.step}" x1="{x(mark.step):.2f}" '
                     f'x2="{x(mark.step):.2f}" y1="{TOP}" y2="{TOP + height}" stroke="#d00" '
                     f'stroke-dasharray="4 3"><title>{_esc(mark.label)}</title></line>'
                     f'<text x="{x(mark.step) + 3:.1f}" y="{TOP + 10}" fill="#d00">'
                     f'{_esc(mark.label)}</text>')
    parts.append("</svg>")
    legend = "".join(f'<span style="color:{COLOURS[i % len(COLOURS)]}">&#9632;</span> '
                     f'{_esc(line.label)}&nbsp;&nbsp; ' for i, line in enumerate(chart.lines))
    return "".join(parts) + f'<div class="legend">{legend}</div>'


def _values_table(chart: Chart) -> str:
    columns = [dict(zip(line.steps, line.values)) for line in chart.lines]
    head = "".join(f"<th>{_esc(h)}</th>" for h in ["step"] + [line.label for line in chart.lines])
    rows = []
    for step in chart.steps():
        cells = "".join(f'<td class="num">{format(c[step], ".6g") if step in c else "-"}</td>'
                        for c in columns)
        rows.append(f'<tr><td class="num">{step}</td>{cells}</tr>')
    return (f'<details><summary>values of {_esc(chart.title)}</summary>'
            f'<table class="fxdebug-series-values"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></details>')


def series_html(view: SeriesView) -> str:
    """A report section: a heading, each chart with the marks, each table, the details."""
    parts = [f"<h2>{_esc(view.title)}</h2>"]
    parts += [f"<p>note: {_esc(note)}</p>" for note in view.notes]
    for chart in view.charts:
        if chart.lines:
            parts.append(line_chart_svg(chart, view.marks) + _values_table(chart))
    for table in view.tables:
        head = "".join(f"<th>{_esc(h)}</th>" for h in table.head)
        body = "".join("<tr>" + "".join(f"<td>{_esc(cell)}</td>" for cell in row) + "</tr>"
                       for row in table.rows)
        parts.append(f"<h3>{_esc(table.caption)}</h3><table><thead><tr>{head}</tr></thead>"
                     f"<tbody>{body}</tbody></table>")
    for summary, text in view.details:
        parts.append(f"<details><summary>{_esc(summary)}</summary><pre>{_esc(text)}</pre>"
                     f"</details>")
    return "".join(parts)
