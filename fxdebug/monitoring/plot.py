"""A monitor's series as a picture: the keys that moved most, the loss, the spike steps.

::

    chart_data(series, keys=None, stat="rms", kinds=("out",), ...)   a SeriesView (plain data):
        ├─ chart 1: <stat> of each key (default: the top rows of series.drift())
        ├─ chart 2: the loss that step(loss) recorded (its mean), when there is one
        ├─ marks:   every spike step of series.spikes
        └─ tables:  the drift table, the spikes (step, trigger, reproduced, first divergence)
    series_figure(series, ...)   a matplotlib Figure of it (nothing global touched)
    plot_series(series, path, ...)   that Figure saved as a PNG
    fxdebug.report(series, "r.html")   the same view as an HTML section (inline SVG)

>>> import os, tempfile, torch, fxdebug
>>> folder = tempfile.mkdtemp()
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> with fxdebug.monitor(net, every=1, folder=folder) as mon:
...     for _ in range(3):
...         loss = net(torch.ones(1, 2)).sum(); loss.backward(); mon.step(loss)
>>> view = chart_data(fxdebug.load_series(folder))
>>> [[line.label for line in chart.lines] for chart in view.charts]
[['0.out.rms'], ['loss.out.mean']]
"""

from __future__ import annotations

import os

from ..errors import FxdebugError
from ..reporting.plots import save_figure, view_figure
from ..reporting.series_view import Chart, Line, Mark, SeriesView, Table
from .statistics import KINDS, STATS

__all__ = ["chart_data", "series_figure", "plot_series", "LOSS_STAT"]

LOSS_STAT = "mean"
"""The loss is drawn as its mean: the value ``step(loss)`` was given (over micro-batches
and ranks, their mean)."""

_LABEL = 40  # characters of a spike's label on a chart


def _text(value) -> str:
    return "-" if value is None else "yes" if value is True else "no" if value is False else str(value)


def _short(text: str, width: int = _LABEL) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def spike_rows(spikes: list[dict]) -> list[tuple[str, ...]]:
    """Step, trigger, reproduced, first divergence, first non-finite, rank of each spike.

    >>> spike_rows([{"step": 7, "trigger": "loss is nan", "reproduced": True,
    ...              "first_divergence": "fc1", "first_nonfinite": None, "rank": 0}])
    [('7', 'loss is nan', 'yes', 'fc1', '-', '0')]
    """
    return [tuple(_text(spike.get(name)) for name in
                  ("step", "trigger", "reproduced", "first_divergence", "first_nonfinite", "rank"))
            for spike in spikes]


def _pairs(series, keys, kinds, rank, drift) -> list[tuple[str, str]]:
    if keys is None:
        return [(row.key, row.kind) for row in drift.rows]
    if isinstance(keys, str):
        keys = [keys]
    pairs = []
    for key in keys:
        have = series._kinds_of(key, rank)
        chosen = [kind for kind in kinds if kind in have]
        if not chosen:
            where = f"{key} has kinds {', '.join(have)}" if have else (
                f"no key {key}; series.keys() lists them")
            raise FxdebugError(f"fxdebug series plot: no {' or '.join(kinds)} series of {key} in "
                               f"{series.folder} ({where}); pass kinds= with one of those.")
        pairs += [(key, kind) for kind in chosen]
    return pairs


def chart_data(series, keys=None, stat: str = "rms", kinds: tuple[str, ...] = ("out",),
               rank: int | None = None, limit: int | None = 6,
               window: int | None = None) -> SeriesView:
    """What :func:`plot_series` draws and the HTML report shows, as a
    :class:`~fxdebug.reporting.series_view.SeriesView`: ``stat`` of ``keys`` (each with
    every kind of ``kinds`` it has; None: the ``limit`` top rows of
    ``series.drift(window, stat, kinds, rank)``), the loss (if recorded) on a chart of its
    own, a mark per spike step, the drift table and the spike list. ``window``: only the
    latest ``window`` logged steps."""
    if stat not in STATS:
        raise FxdebugError(f"fxdebug series plot: unknown stat {stat!r}; the stats are "
                           f"{', '.join(STATS)}.")
    kinds = tuple(kinds)
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise FxdebugError(f"fxdebug series plot: unknown kinds {unknown or kinds!r}; the kinds "
                           f"are {', '.join(KINDS)}.")
    drift = series.drift(window=window, stat=stat, kinds=kinds, rank=rank, limit=limit)
    first = drift.steps[0] if window is not None else None

    def line(key: str, kind: str, name: str) -> Line:
        steps, values = series.get(key, name, kind=kind, rank=rank)
        kept = [(s, v) for s, v in zip(steps, values) if first is None or s >= first]
        return Line(f"{key}.{kind}.{name}", tuple(s for s, _ in kept), tuple(v for _, v in kept))

    whose = "global batch" if rank is None else f"rank {rank}"
    charts = [Chart(f"{stat} of {', '.join(kinds)} ({whose})", stat,
                    tuple(line(key, kind, stat) for key, kind in _pairs(series, keys, kinds,
                                                                        rank, drift)))]
    loss = series.manifest.get("loss")
    if loss and "out" in series._kinds_of(loss, rank):
        charts.append(Chart(f"loss ({whose})", "loss", (line(loss, "out", LOSS_STAT),)))
    spikes = series.spikes
    marks = tuple(Mark(int(s["step"]), _short(f"spike {s['step']}" + (
        f": {s['first_divergence']}" if s.get("first_divergence") else ""))) for s in spikes)
    tables = [Table(drift.table(wide=True).splitlines()[0],
                    ("key", "kind", f"{stat} first", f"{stat} last", "factor"),
                    tuple((r.key, r.kind, f"{r.first:.4g}", f"{r.last:.4g}", f"x{r.factor:.3g}")
                          for r in drift.rows))]
    if spikes:
        tables.append(Table(f"spikes replayed ({len(spikes)})",
                            ("step", "trigger", "reproduced", "first divergence",
                             "first non-finite", "rank"), tuple(spike_rows(spikes))))
    details = tuple((f"spike at step {s['step']}: the replay's report", str(s["text"]))
                    for s in spikes if s.get("text"))
    return SeriesView(f"{os.path.basename(os.path.abspath(series.folder))} (fxdebug.monitor)",
                      tuple(charts), marks, tuple(tables), details, tuple(series.notes))


def series_figure(series, keys=None, stat: str = "rms", kinds: tuple[str, ...] = ("out",),
                  rank: int | None = None, limit: int | None = 6, window: int | None = None):
    """The ``matplotlib.figure.Figure`` of :func:`chart_data` (no pyplot: nothing global
    changes; each series a ``Line2D`` whose ``gid`` is ``<key>.<kind>.<stat>``, each spike a
    vertical line whose ``gid`` is ``mark-<step>``). Needs matplotlib."""
    return view_figure(chart_data(series, keys, stat, kinds, rank, limit, window))


def plot_series(series, path: str | os.PathLike, keys=None, stat: str = "rms",
                kinds: tuple[str, ...] = ("out",), rank: int | None = None,
                limit: int | None = 6, window: int | None = None) -> str:
    """Save :func:`series_figure` as a PNG at ``path``; return the path."""
    return save_figure(series_figure(series, keys, stat, kinds, rank, limit, window),
                       os.fspath(path))
