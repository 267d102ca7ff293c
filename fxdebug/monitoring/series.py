"""``fxdebug.load_series``: a monitor's folder read back, per key, kind, stat and rank.

::

    series = load_series("runs/series")
    series.keys()                          keys in the order first recorded
    series.get("fc1", "rms")               (steps, values) of the global batch's fc1.out.rms
    series.get("fc1", "ratio", kind="update", rank=1)     one rank's own
    series.drift(window=20)                DriftReport: the keys that moved most
    series.spikes                          the spikes the monitor replayed, by step
    series.plot("drift.png")               the top keys' rms and the loss, spikes marked
    fxdebug.report(series, "series.html")  the same as inline SVG, with the tables

A torn last line (a crash while it was written) is skipped and named in
``series.notes``; a step written twice (a resumed run) keeps its latest numbers.
"""

from __future__ import annotations

import difflib
import json
import os
import re

from ..errors import FxdebugError
from .drift import DriftReport, drift_rows
from .folder import FORMAT, GLOBAL, MANIFEST, SPIKES
from .plot import chart_data, plot_series, series_figure
from .statistics import KINDS, STATS, UPDATE_STATS, derived, split_slot

__all__ = ["Series", "load_series"]

_RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")


def load_series(folder: str | os.PathLike) -> "Series":
    """Read a folder written by ``fxdebug.monitor(model, folder=...)``.

    >>> import tempfile, torch, fxdebug
    >>> folder = tempfile.mkdtemp()
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> with fxdebug.monitor(net, every=1, folder=folder) as mon:
    ...     for _ in range(3):
    ...         net(torch.ones(1, 2)).sum().backward(); mon.step()
    >>> series = fxdebug.load_series(folder)
    >>> series.keys(), series.get("0", "count")
    (['0'], ([0, 1, 2], [2.0, 2.0, 2.0]))
    """
    return Series(folder)


class Series:
    """The statistics a monitor wrote, per step (see :func:`load_series`)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = os.fspath(folder)
        manifest = os.path.join(self.folder, MANIFEST)
        if not os.path.isfile(manifest):
            raise FxdebugError(
                f"fxdebug.load_series: {self.folder} has no {MANIFEST}: not a folder written by "
                f"fxdebug.monitor(model, folder=...). Pass the folder= given to the monitor.")
        with open(manifest, encoding="utf-8") as handle:
            self.manifest = json.load(handle)
        if self.manifest.get("format") != FORMAT:
            raise FxdebugError(f"fxdebug.load_series: {manifest} is not a series manifest "
                               f"(format {self.manifest.get('format')!r}, not {FORMAT!r}).")
        self.notes: list[str] = []
        found = sorted((int(m.group(1)), name) for name in os.listdir(self.folder)
                       if (m := _RANK_FILE.match(name)))
        self.ranks: list[int] = [rank for rank, _ in found]
        self._per_rank = {rank: self._read(name) for rank, name in found}
        path = os.path.join(self.folder, GLOBAL)
        if os.path.exists(path):
            self._global = self._read(GLOBAL)
        elif len(self.ranks) == 1:
            self._global = self._per_rank[self.ranks[0]]
        else:
            self._global = {}
            if self.ranks:
                self.notes.append(f"{GLOBAL} is missing: only per-rank series (rank=)")
        self.spikes: list[dict] = self._read_spikes()

    def _read_spikes(self) -> list[dict]:
        """The spikes the monitor replayed (``spikes.jsonl``), by step; a resumed run's
        second record of a step keeps the latest."""
        if not os.path.exists(os.path.join(self.folder, SPIKES)):
            return []
        found = {step: entry for step, entry in self._lines(SPIKES, ())}
        return [found[step] for step in sorted(found)]

    def _read(self, name: str) -> dict[int, dict[str, list[float]]]:
        steps: dict[int, dict[str, list[float]]] = {}
        for step, entry in self._lines(name, ("rows",)):
            steps.setdefault(step, {}).update(entry["rows"])
        return dict(sorted(steps.items()))

    def _lines(self, name: str, fields: tuple[str, ...]) -> list[tuple[int, dict]]:
        """``(step, entry)`` of every readable line of ``name``; a line that is not JSON or
        lacks ``step`` or ``fields`` is skipped and named in ``notes`` (the last one: torn
        by a crash while it was written)."""
        with open(os.path.join(self.folder, name), encoding="utf-8") as handle:
            lines = handle.read().split("\n")
        found = []
        for number, text in enumerate(lines, 1):
            if not text.strip():
                continue
            try:
                entry = json.loads(text)
                step = int(entry["step"])
                missing = [field for field in fields if field not in entry]
                if missing:
                    raise KeyError(missing[0])
            except (ValueError, KeyError, TypeError) as exc:
                torn = number == len(lines)  # the last line, without its newline
                self.notes.append(f"{name}:{number}: {'torn last line' if torn else 'unreadable'}"
                                  f" skipped ({type(exc).__name__})")
                continue
            found.append((step, entry))
        return found

    def _source(self, rank: int | None) -> dict[int, dict[str, list[float]]]:
        if rank is None:
            return self._global
        if rank not in self._per_rank:
            raise FxdebugError(f"fxdebug.load_series: no series of rank {rank} in {self.folder}; "
                               f"it holds ranks {self.ranks}.")
        return self._per_rank[rank]

    def keys(self, rank: int | None = None) -> list[str]:
        """Every key, in the order first recorded (of the global series, or of ``rank``)."""
        found: dict[str, None] = {}
        for rows in self._source(rank).values():
            for name in rows:
                found.setdefault(split_slot(name)[0], None)
        return list(found)

    def _kinds_of(self, key: str, rank: int | None = None) -> list[str]:
        """The kinds recorded for ``key``, in the order of KINDS."""
        found = {split_slot(name)[1] for rows in self._source(rank).values() for name in rows
                 if split_slot(name)[0] == key}
        return [kind for kind in KINDS if kind in found]

    @property
    def steps(self) -> list[int]:
        """The logged steps (of the global series)."""
        return list(self._global)

    def get(self, key: str, stat: str, kind: str = "out",
            rank: int | None = None) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of ``<key>.<kind>.<stat>``: the global batch's, or ``rank``'s own."""
        if kind not in KINDS:
            raise FxdebugError(f"fxdebug.load_series: unknown kind {kind!r}; the kinds are "
                               f"{', '.join(KINDS)}.")
        allowed = UPDATE_STATS if kind == "update" else STATS
        if stat not in allowed:
            raise FxdebugError(f"fxdebug.load_series: unknown stat {stat!r} for kind {kind!r}; "
                               f"the stats are {', '.join(allowed)}.")
        source = self._source(rank)
        name = f"{key}.{kind}"
        steps, values = [], []
        for step, rows in source.items():
            row = rows.get(name)
            if row is None:
                continue
            params = rows.get(f"{key}.param") if kind == "update" else None
            steps.append(step)
            values.append(derived(row, params)[stat])
        if not steps:
            keys = self.keys(rank)
            close = difflib.get_close_matches(key, keys, n=3)
            where = f" (closest keys: {', '.join(close)})" if close else ""
            kinds = sorted({split_slot(n)[1] for rows in source.values() for n in rows
                            if split_slot(n)[0] == key})
            have = f"; {key} has kinds {', '.join(kinds)}" if kinds else where
            raise FxdebugError(f"fxdebug.load_series: no series {name}.{stat} in "
                               f"{self.folder}{have}. series.keys() lists the keys.")
        return steps, values

    def drift(self, window: int | None = None, stat: str = "rms",
              kinds: tuple[str, ...] = ("out", "param"), rank: int | None = None,
              limit: int | None = 10) -> DriftReport:
        """The keys whose ``stat`` moved most between the first and the last of the latest
        ``window`` logged steps (None: all), as a factor last / first. The loss that
        ``step(loss)`` recorded is no module and is left out."""
        if window is not None and (not isinstance(window, int) or window < 2):
            raise FxdebugError(f"fxdebug.load_series: drift(window=) takes at least 2 logged "
                               f"steps, or None for all; got {window!r}.")
        source = self._source(rank)
        steps = list(source)
        if window is not None:
            steps = steps[-window:]
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        loss = self.manifest.get("loss")
        for step in steps:
            rows = source[step]
            for name, row in rows.items():
                key, kind = split_slot(name)
                if kind in kinds and key != loss:
                    value = derived(row)[stat]
                    series.setdefault((key, kind), []).append((step, value))
        return DriftReport(folder=self.folder, stat=stat, rank=rank,
                           steps=(steps[0], steps[-1]) if steps else (0, 0),
                           rows=drift_rows(series, limit))

    def chart_data(self, keys: str | list[str] | None = None, stat: str = "rms",
                   kinds: tuple[str, ...] = ("out",), rank: int | None = None,
                   limit: int | None = 6, window: int | None = None):
        """What :meth:`plot` draws and ``fxdebug.report(series, path)`` shows, as plain data
        (a :class:`fxdebug.reporting.series_view.SeriesView`; see :meth:`plot`)."""
        return chart_data(self, keys, stat, kinds, rank, limit, window)

    def figure(self, keys: str | list[str] | None = None, stat: str = "rms",
               kinds: tuple[str, ...] = ("out",), rank: int | None = None,
               limit: int | None = 6, window: int | None = None):
        """The ``matplotlib.figure.Figure`` :meth:`plot` saves (no pyplot, nothing global)."""
        return series_figure(self, keys, stat, kinds, rank, limit, window)

    def plot(self, path: str | os.PathLike, keys: str | list[str] | None = None,
             stat: str = "rms", kinds: tuple[str, ...] = ("out",), rank: int | None = None,
             limit: int | None = 6, window: int | None = None) -> str:
        """Save a PNG of ``stat`` over the logged steps; return its path.

        One axis holds ``keys`` (each with every kind of ``kinds`` it has; default: the
        ``limit`` keys that moved most, :meth:`drift`'s top rows), log scale where every
        value is positive and they span a factor of 10 or more; a second the loss ``step(loss)`` recorded (its mean), if any;
        every spike step of :attr:`spikes` is a dashed red line, labelled. ``rank``: that
        rank's own series; ``window``: only the latest logged steps. Needs matplotlib;
        draws on a Figure of its own (no pyplot, the backend and rcParams left alone).

        >>> import os, tempfile, torch, fxdebug
        >>> folder = tempfile.mkdtemp()
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> with fxdebug.monitor(net, every=1, folder=folder) as mon:
        ...     for _ in range(3):
        ...         net(torch.ones(1, 2)).sum().backward(); mon.step()
        >>> path = fxdebug.load_series(folder).plot(os.path.join(folder, "drift.png"))
        >>> open(path, "rb").read(4)
        b'\\x89PNG'
        """
        return plot_series(self, path, keys, stat, kinds, rank, limit, window)

    def _repr_html_(self) -> str:
        from ..reporting.series_html import series_html
        return series_html(self.chart_data())

    def __repr__(self) -> str:
        span = f"steps {self.steps[0]}-{self.steps[-1]}" if self.steps else "no steps"
        return (f"<Series {self.folder}: {len(self.keys())} keys, {len(self.steps)} logged "
                f"{span}, ranks {self.ranks}>")


