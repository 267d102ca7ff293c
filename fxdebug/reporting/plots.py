"""Pictures of a run: activation and gradient norms per node, in execution order; a
:class:`~fxdebug.reporting.series_view.SeriesView` (values over training steps, spike
steps marked).

Needs matplotlib, an optional extra: ``pip install 'fxdebug[plot]'``. Figures
are drawn on a ``matplotlib.figure.Figure`` of their own: no pyplot state, no
change of the matplotlib backend (a notebook's inline figures stay as they were).
"""

from __future__ import annotations

import math

from ..errors import FxdebugError
from ..runtime import Records
from .series_view import SeriesView

__all__ = ["plot_norms", "require_matplotlib", "view_figure", "save_figure"]


def require_matplotlib():
    """``matplotlib.figure.Figure``, or an FxdebugError that says how to install matplotlib.

    >>> require_matplotlib().__name__
    'Figure'
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise FxdebugError("plotting needs matplotlib, an optional extra: pip install "
                           "'fxdebug[plot]' (or pip install matplotlib), then run again.") from None
    return Figure


def plot_norms(records: Records, path: str, title: str = "") -> str:
    """Draw the L2 norm of every captured activation (and its gradient) per node; save a PNG.

    Args:
        records: ``fxdebug.records(gm)`` after a forward (and backward, for gradients).
        path: where to write the image.
        title: a title for the figure.

    Returns:
        ``path``.

    Example::

        >>> import os, tempfile, torch, fxdebug
        >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)), grads=True)
        >>> gm(torch.ones(1, 2)).sum().backward()
        >>> path = plot_norms(fxdebug.records(gm), os.path.join(tempfile.mkdtemp(), "n.png"))
        >>> open(path, "rb").read(4)
        b'\\x89PNG'
    """
    figure_class = require_matplotlib()
    keys = records.keys()
    if not keys:
        raise FxdebugError("nothing to plot: the records are empty. Run the instrumented module "
                           "once before plotting.")
    activations = [records.record(key).stats.norm for key in keys]
    grads = [records.grads.record(key).stats.norm if key in records.grads else math.nan
             for key in keys]
    figure = figure_class(figsize=(max(6.0, 0.18 * len(keys)), 4.5))
    axis = figure.subplots()
    positions = list(range(len(keys)))
    axis.plot(positions, activations, marker="o", markersize=3, label="activation norm")
    if any(not math.isnan(g) for g in grads):
        axis.plot(positions, grads, marker="s", markersize=3, label="gradient norm")
    axis.set_yscale("log")
    axis.set_xticks(positions)
    axis.set_xticklabels(keys, rotation=90, fontsize=6)
    axis.set_xlabel("node, in execution order")
    axis.set_ylabel("L2 norm")
    axis.set_title(title or "activation and gradient norms per node")
    axis.legend()
    figure.tight_layout()
    return save_figure(figure, path)


def save_figure(figure, path: str) -> str:
    """Write ``figure`` as a PNG through its own canvas (no pyplot, no backend switch).

    >>> import os, tempfile
    >>> figure = require_matplotlib()()
    >>> path = save_figure(figure, os.path.join(tempfile.mkdtemp(), "f.png"))
    >>> open(path, "rb").read(4)
    b'\\x89PNG'
    """
    figure.savefig(path, dpi=120, metadata={"Software": None})  # its own Agg canvas
    return path


def view_figure(view: SeriesView):
    """A ``matplotlib.figure.Figure`` of a SeriesView: one axis per chart with lines (the
    first the tallest), steps shared, log scale where :attr:`Chart.log`, each mark a dashed
    red vertical line on every axis (``gid`` ``mark-<step>``) labelled on the top one.
    Each series is a ``Line2D`` whose ``gid`` is its label; non-finite values are gaps.

    >>> from fxdebug.reporting.series_view import Chart, Line, Mark, SeriesView
    >>> view = SeriesView("run", (Chart("rms", "rms", (Line("a", (0, 5), (1.0, 4.0)),)),),
    ...                   marks=(Mark(5, "spike 5"),))
    >>> axis = view_figure(view).axes[0]
    >>> [(l.get_gid(), [int(x) for x in l.get_xdata()]) for l in axis.get_lines()]
    [('a', [0, 5]), ('mark-5', [5, 5])]
    """
    figure_class = require_matplotlib()
    charts = [chart for chart in view.charts if chart.lines]
    if not charts:
        raise FxdebugError(f"nothing to plot in {view.title}: no series with a value. Pass "
                           f"keys= (series.keys() lists them), or log more steps.")
    ratios = [2.0] + [1.0] * (len(charts) - 1)
    figure = figure_class(figsize=(7.5, 2.2 + 2.0 * sum(ratios)))
    axes = figure.subplots(len(charts), 1, sharex=True, squeeze=False,
                           gridspec_kw={"height_ratios": ratios})[:, 0]
    for axis, chart in zip(axes, charts):
        for line in chart.lines:
            values = [v if math.isfinite(v) else math.nan for v in line.values]
            axis.plot(list(line.steps), values, marker="o", markersize=2.5, linewidth=1.2,
                      label=line.label, gid=line.label)
        if chart.log:
            axis.set_yscale("log")
        for mark in view.marks:
            axis.axvline(mark.step, color="#d00", linestyle="--", linewidth=1,
                         gid=f"mark-{mark.step}")
        axis.set_ylabel(chart.ylabel)
        axis.set_title(chart.title, fontsize=9, loc="left")
        axis.legend(fontsize=7, loc="best")
        axis.grid(True, alpha=0.3)
    for mark in view.marks:
        axes[0].text(mark.step, 0.98, f" {mark.label}", transform=axes[0].get_xaxis_transform(),
                     rotation=90, va="top", ha="left", fontsize=7, color="#d00",
                     gid=f"mark-{mark.step}")
    axes[-1].set_xlabel("step")
    figure.suptitle(view.title, fontsize=10)
    figure.tight_layout()
    return figure
