"""``RankReport``: what :func:`fxdebug.compare_ranks` found, identical on every rank.

Built from the fingerprints every rank sent (see :mod:`fxdebug.distributed.ranks`)::

    RankReport
      ├─ entries           one RankEntry per key, in execution order: status, the ranks
      │                    that differ from the majority, per-rank norms
      ├─ first_divergence  the first entry that differs (key, kind, ranks, detail)
      ├─ table()           verdict, first divergence, the entries that differ (80 columns)
      └─ to_dict()         JSON-safe, for a CI log

>>> entry = RankEntry("fc.weight", "parameter", "2x2", "float32", "differs", (1,), (0, 2),
...                   (2.0, 2.5, 2.0), "norm 2.5 vs 2")
>>> report = RankReport("module Net: parameters", (0, 1, 2), [entry], "gloo")
>>> report.ok, report.first_divergence.key, report.first_divergence.ranks
(False, 'fc.weight', (1,))
>>> RankReport("Linear", (0,), [RankEntry("w", "parameter", "2", "float32", "one copy", (), (),
...                                       (1.0,))]).verdict_text
'NOTHING TO COMPARE'
>>> report
<RankReport 1 key(s) on 3 ranks, DIFFERENT: first divergence fc.weight (parameter) on rank 1: norm 2.5 vs 2>
"""

from __future__ import annotations

import dataclasses

from ..base.fit_to_width import fit_table, table_width
from ..base.report import Report
from .rank_group import on_ranks, ranks_text

__all__ = ["RankReport", "RankEntry", "DIVERGENT", "NOT_COMPARED", "STATUS_TEXT",
           "tolerance_text"]


def tolerance_text(rtol: float, atol: float) -> str:
    """``rtol=1e-05``, with ``, atol=...`` when an atol was given.

    >>> tolerance_text(1e-5, 0.0), tolerance_text(0.0, 1e-8)
    ('rtol=1e-05', 'rtol=0, atol=1e-08')
    """
    return f"rtol={rtol:g}" + (f", atol={atol:g}" if atol else "")


#: Statuses that make a report not ok.
DIVERGENT = ("differs", "shape", "missing")
#: Statuses of keys that were not compared across ranks (a verdict over them is never EQUAL).
NOT_COMPARED = ("stale", "one copy")

STATUS_TEXT = {
    "equal": "equal",
    "close": "close",            # bits differ, norm and max|x| within rtol
    "differs": "DIFFERS",
    "shape": "SHAPE",            # shape or dtype differ
    "missing": "MISSING",        # the key is absent on some ranks
    "stale": "stale",            # a capture written in place after it was taken: not compared
    "one copy": "one copy",      # sharded: each element is held by one rank only
    "resynced": "resynced",      # a buffer DDP copies from rank 0 at every forward
}


@dataclasses.dataclass(frozen=True)
class RankEntry:
    """One key compared across ranks.

    ``ranks`` are the global ranks whose value differs from the majority (the
    largest group of ranks holding bitwise-equal values; on a tie, the group of
    the lowest rank); ``majority`` the ranks of that group. ``norms`` holds each
    rank's L2 norm of its value, in group order (None where the key is absent).
    """

    key: str
    kind: str
    shape: str
    dtype: str
    status: str
    ranks: tuple[int, ...]
    majority: tuple[int, ...]
    norms: tuple[float | None, ...]
    detail: str = ""
    placement: str = ""

    @property
    def ok(self) -> bool:
        return self.status not in DIVERGENT

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """``fc.weight (parameter) on rank 1: norm 2.5 vs 2``."""
        where = f" on {on_ranks(self.ranks)}" if self.ranks else ""
        return f"{self.key} ({self.kind}){where}: {self.detail or STATUS_TEXT[self.status]}"


@dataclasses.dataclass(repr=False)
class RankReport(Report):
    """What :func:`fxdebug.compare_ranks` found: ``ok`` when every key was compared and is equal
    on every rank. ``verdict_text``: ``"EQUAL"``; ``"DIFFERENT"``; ``"INCOMPLETE"`` (what was
    compared agrees, but some keys hold one copy only, each element on one rank, or are stale);
    ``"NOTHING TO COMPARE"`` (no key has a second copy: a world of one rank, or every tensor
    sharded, as FSDP2's parameters).

    ``world`` lists the group's global ranks; ``entries`` every key in execution order
    (:class:`RankEntry`); ``first_divergence`` the first entry that differs, or None.
    Every rank builds this report from the same fingerprints: its table and
    ``to_dict()`` are the same on every rank.
    """

    what: str
    world: tuple[int, ...]
    entries: list[RankEntry]
    backend: str = ""
    rtol: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    atol: float | None = None

    verdict_words = ("EQUAL", "DIFFERENT")

    @property
    def ok(self) -> bool:
        """Every key compared, and equal on every rank (a verdict covers only what it compared)."""
        return self.verdict_text == "EQUAL"

    @property
    def not_compared(self) -> list[RankEntry]:
        """Entries with no second copy to compare (sharded, a world of one rank) or stale."""
        return [entry for entry in self.entries if entry.status in NOT_COMPARED]

    @property
    def compared(self) -> int:
        """How many keys were compared across ranks."""
        return len(self.entries) - len(self.not_compared)

    @property
    def verdict_text(self) -> str:
        """``"EQUAL"``, ``"DIFFERENT"``, ``"INCOMPLETE"`` or ``"NOTHING TO COMPARE"``."""
        if any(not entry.ok for entry in self.entries):
            return "DIFFERENT"
        if not self.compared:
            return "NOTHING TO COMPARE"
        return "INCOMPLETE" if self.not_compared else "EQUAL"

    def __repr__(self) -> str:
        text = super().__repr__()
        verdict = self.verdict_text
        return text if verdict in ("EQUAL", "DIFFERENT") else \
            text.replace(", DIFFERENT", f", {verdict}", 1)

    @property
    def divergences(self) -> list[RankEntry]:
        """Entries that differ (value, shape or presence), in execution order."""
        return [entry for entry in self.entries if not entry.ok]

    @property
    def first_divergence(self) -> RankEntry | None:
        return next((entry for entry in self.entries if not entry.ok), None)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that differs from the majority at some key, in group order."""
        found = {rank for entry in self.divergences for rank in entry.ranks}
        return tuple(rank for rank in self.world if rank in found)

    def _size(self) -> str:
        ranks = "rank" if len(self.world) == 1 else "ranks"
        return f"{len(self.entries)} key(s) on {len(self.world)} {ranks}"

    def _finding(self) -> str:
        first = self.first_divergence
        return "" if first is None else f"first divergence {first.describe()}"

    def _fields(self) -> dict:
        return {"what": self.what, "world": list(self.world), "backend": self.backend,
                "rtol": self.rtol, "atol": self.atol, "keys": len(self.entries), "verdict": self.verdict_text,
                "compared": self.compared,
                "first_divergence": self.first_divergence, "ranks": list(self.ranks),
                "divergences": self.divergences,
                "not_compared": self.not_compared,
                "notes": self.notes}

    def table(self, wide: bool | None = None) -> str:
        """Verdict, first divergence, and every key that is not equal on every rank."""
        how = ("bitwise" if self.rtol is None and self.atol is None
               else f"bitwise, or norm and max|x| within "
                    f"{tolerance_text(self.rtol or 0.0, self.atol or 0.0)}")
        lines = [f"compare_ranks: {self.what}; {on_ranks(self.world)}"
                 f"{f' ({self.backend})' if self.backend else ''}; compared {how}"]
        counts: dict[str, int] = {}
        for entry in self.entries:
            counts[entry.status] = counts.get(entry.status, 0) + 1
        bad = self.divergences
        skipped = len(self.not_compared)
        why = ", ".join(f"{counts[s]} {STATUS_TEXT[s]}" for s in NOT_COMPARED if s in counts)
        ranks = f"all {len(self.world)} ranks" if len(self.world) > 1 else "the one rank"
        verdict = self.verdict_text
        if verdict == "EQUAL":
            lines.append(f"verdict: EQUAL: all {self.compared} keys compared and agree on {ranks}")
        elif verdict == "NOTHING TO COMPARE":
            reason = ("a world of one rank" if len(self.world) == 1 else
                      f"every key is held as one copy ({why})")
            lines.append(f"verdict: NOTHING TO COMPARE: {reason}; none of the "
                         f"{len(self.entries)} keys has a second copy on another rank")
        elif verdict == "INCOMPLETE":
            lines.append(f"verdict: INCOMPLETE: the {self.compared} keys compared agree on "
                         f"{ranks}; {skipped} of {len(self.entries)} not compared ({why})")
        else:
            lines.append(f"verdict: DIFFERENT: {len(bad)} of {len(self.entries)} keys differ, "
                         f"on {on_ranks(self.ranks)}" + (f"; {skipped} not compared ({why})"
                                                         if skipped else ""))
            lines.append(f"first divergence: {bad[0].describe()}")
        shown = [e for e in self.entries if e.status != "equal"]
        if shown:
            rows = [[e.key, e.kind, e.shape, STATUS_TEXT[e.status], ranks_text(e.ranks) if e.ranks
                     else "-", e.detail] for e in shown]
            lines.append("")
            lines.append(fit_table(rows, ["key", "kind", "shape", "status", "ranks", "detail"],
                                   width=table_width(wide), drop=("shape",),
                                   truncate=("key", "detail")))
        summary = ", ".join(f"{counts[status]} {text}" for status, text in STATUS_TEXT.items()
                            if status in counts)
        lines.append(f"keys: {summary or 'none'}")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)
