"""The series folder: one JSON-lines file per rank, the global batch's, and a manifest.

::

    runs/series/
      manifest.json        {"format": "fxdebug-series", "version": 1, "columns": [...10],
                            "every": 100, "start": 0, "end": null, "loss": "loss",
                            "world": 2}    ("loss": the key of step(loss)'s loss, if any)
      rank-0.jsonl         this rank's own statistics (its part of the batch)
      rank-1.jsonl
      global.jsonl         the global batch's (ranks merged), written by the group's first
                           rank; absent in a single process, where rank-0.jsonl is global
      spikes.jsonl         one line per spike the monitor replayed (written by the group's
                           first rank): {"step", "trigger", "reproduced", "first_divergence",
                           "first_nonfinite", "rank", "text"}; absent while there is none

Each line is one step's moment summaries (:mod:`fxdebug.stats.moments`, ten
numbers each, as Python's ``json`` writes floats: ``NaN`` and ``Infinity`` included),
written whole and flushed as soon as it is known::

    {"step":100,"rows":{"fc1.out":[...],"fc1.grad":[...],"fc1.param":[...]}}
    {"step":100,"rows":{"fc1.update":[...]}}     (the update: measured at the next step)

Files are only ever appended to (a run resumed into the same folder continues them; a
step written twice keeps its latest numbers), so a crash loses at most the line being
written, and the loader skips such a torn last line. Nothing in the files depends on
time, paths or hash order: identical runs write identical bytes.

>>> import tempfile, os
>>> folder = SeriesFolder(tempfile.mkdtemp(), rank=0, world=1, config={"every": 1})
>>> folder.write(3, {"fc.out": [1.0] * 10})
>>> folder.close()
>>> open(os.path.join(folder.path, "rank-0.jsonl")).read()
'{"step":3,"rows":{"fc.out":[1.0,1.0,1.0,1.0,1.0,1.0,1.0,1.0,1.0,1.0]}}\\n'
"""

from __future__ import annotations

import json
import os
from typing import IO, Sequence

from ..errors import FxdebugError
from ..stats.moments import MOMENT_COLUMNS

__all__ = ["SeriesFolder", "FORMAT", "VERSION", "MANIFEST", "GLOBAL", "SPIKES", "rank_file"]

FORMAT = "fxdebug-series"
VERSION = 1
MANIFEST = "manifest.json"
GLOBAL = "global.jsonl"
SPIKES = "spikes.jsonl"


def rank_file(rank: int) -> str:
    """The file name of one rank's series.

    >>> rank_file(3)
    'rank-3.jsonl'
    """
    return f"rank-{rank}.jsonl"


def line(step: int, rows: dict[str, Sequence[float]]) -> str:
    """One step's line (no spaces, keys in the order given)."""
    return json.dumps({"step": step, "rows": {name: [float(v) for v in row]
                                              for name, row in rows.items()}},
                      separators=(",", ":")) + "\n"


class SeriesFolder:
    """Appends one rank's lines (and, on the group's first rank of several, the global
    lines) to a series folder; writes the manifest if there is none."""

    def __init__(self, path: str | os.PathLike, rank: int, world: int, config: dict,
                 first: bool = True) -> None:
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        manifest = os.path.join(self.path, MANIFEST)
        if first:
            self._check_or_write(manifest, dict({"format": FORMAT, "version": VERSION,
                                                 "columns": list(MOMENT_COLUMNS)},
                                                **config, world=world))
        self._own: IO[str] | None = open(os.path.join(self.path, rank_file(rank)), "a",
                                         encoding="utf-8")
        self._global: IO[str] | None = None
        self._first = first
        if first and world > 1:
            self._global = open(os.path.join(self.path, GLOBAL), "a", encoding="utf-8")

    def _check_or_write(self, manifest: str, content: dict) -> None:
        if os.path.exists(manifest):
            try:
                with open(manifest, encoding="utf-8") as handle:
                    found = json.load(handle)
            except (OSError, ValueError) as exc:
                raise FxdebugError(f"fxdebug.monitor: {manifest} exists but is not a series "
                                   f"manifest ({exc}); pass another folder= (fxdebug writes "
                                   f"only into folders it made or can read).") from exc
            if not isinstance(found, dict) or found.get("format") != FORMAT:
                raise FxdebugError(f"fxdebug.monitor: {self.path} holds a {MANIFEST} that is "
                                   f"not fxdebug's series manifest; pass another folder=.")
            return  # a resumed run: append to what is there
        partial = manifest + ".partial"
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump(content, handle, indent=1)
            handle.write("\n")
        os.replace(partial, manifest)

    def write(self, step: int, rows: dict[str, Sequence[float]],
              global_rows: dict[str, Sequence[float]] | None = None) -> None:
        """Append this rank's rows of ``step`` (and the global rows, on the first rank)."""
        if self._own is not None and rows:
            self._own.write(line(step, rows))
            self._own.flush()
        if self._global is not None and global_rows:
            self._global.write(line(step, global_rows))
            self._global.flush()

    def write_spike(self, record: dict) -> None:
        """Append one replayed spike's line (on the group's first rank; keys sorted)."""
        if not self._first:
            return
        with open(os.path.join(self.path, SPIKES), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Close the files (what was written stays)."""
        for handle in (self._own, self._global):
            if handle is not None:
                handle.close()
        self._own = self._global = None
