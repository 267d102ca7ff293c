"""Key by key: one key of two runs compared (tensors or statistics), for :mod:`.run_comparison`.

    compare_all(a, b, section)     every key of a in a's order, then the keys only b has
      compare_key(ra, rb)          stale / not assembled / shape / values or statistics;
                                   a sharded run whose ranks hold different values with no
                                   known placement is resolved against the other run first
                                   (:meth:`~fxdebug.distributed.sharded.ShardedRecord.resolve_against`)

A key resolved that way is compared by the resolution's checks (each rank's piece against what
the layout says it must hold), so one bad rank is never hidden behind a good copy; the value
the layout assembles is kept in ``resolved`` for a reference run to judge.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..equivalence.compare import compare_tensors, default_tolerances, dtype_text, format_error, shape_text
from ..runtime.record import Record
from ..runtime.records import Records
from .rounding import ROUNDING_FACTOR, rounding_dtype, rounding_ratio, stats_rounding_ratio
from ..distributed.sharded import ShardedRecord, unassembled

__all__ = ["RunEntry", "compare_all", "compare_key", "STATUS_TEXT", "DIVERGENT", "NOT_COMPARED"]

STATUS_TEXT = {
    "equal": "equal",          # bitwise
    "close": "close",          # within the tolerances
    "differs": "DIFFERS",
    "shape": "SHAPE",          # another shape, or an integer dtype against another
    "only a": "only in a",
    "only b": "only in b",
    "stale": "stale",          # written in place after its capture in a run: not compared
    "rounding": "rounding",    # with a reference: b no further from it than rounding explains
    "beyond": "BEYOND",        # with a reference: b further from it than a is, beyond rounding
    "unassembled": "not assembled",  # a sharded run's pieces do not make a full value
}
DIVERGENT = ("differs", "shape", "only a", "only b", "beyond")
NOT_COMPARED = ("stale", "unassembled", "only a", "only b")
"""Statuses of keys whose values were not compared: a verdict over them is never "equal"."""


@dataclasses.dataclass(frozen=True)
class RunEntry:
    """One key compared across the two runs (``section``: ``"forward"`` or ``"grad"``)."""

    key: str
    op: str
    location: str
    section: str
    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    shape: str = ""
    dtype: str = ""
    detail: str = ""
    rounding: float | None = None  # across dtypes: error norm / (eps(rounding_dtype) * norm)
    rounding_dtype: str = ""
    last_bits: float | None = None  # one dtype in both: error norm / (eps(dtype) * norm)
    err_a: float | None = None      # with a reference r: ||a - r|| / ||r||
    err_b: float | None = None      # ... and ||b - r|| / ||r||
    bound: float | None = None      # ... b diverges where err_b > bound
    by_stats: bool = False          # ... the errors of the statistics (stats-only captures)
    ranks: tuple[int, ...] = ()  # sharded runs: the ranks whose shard holds the differences
    layout: str = ""  # a sharded key of unknown placement: the layout resolved (unknown_placement)

    @property
    def ok(self) -> bool:
        return self.status not in DIVERGENT

    @property
    def compared(self) -> bool:
        """Whether the two runs' values (or statistics) of this key were compared."""
        return self.status not in NOT_COMPARED

    @property
    def beyond_rounding(self) -> bool:
        """Compared across dtypes, and further apart than that rounding explains."""
        return self.rounding is not None and self.rounding > ROUNDING_FACTOR

    def describe(self) -> str:
        """``layer1.0.conv1 (Conv2d, resnet.py:92): max abs 0.5, max rel 1.2``."""
        where = ", ".join(part for part in (self.op, self.location) if part)
        what = "gradient of " if self.section == "grad" else ""
        if self.status in ("only a", "only b", "shape", "stale", "unassembled"):
            text = self.detail or STATUS_TEXT[self.status]
        elif self.err_b is not None:
            stats = " (statistics)" if self.by_stats else ""
            text = (f"err(b,r) {format_error(self.err_b)} vs err(a,r) "
                    f"{format_error(self.err_a or 0.0)}{stats}, bound {format_error(self.bound or 0.0)}; "
                    f"max abs {format_error(self.max_abs)}, max rel {format_error(self.max_rel)}")
        else:
            text = f"max abs {format_error(self.max_abs)}, max rel {format_error(self.max_rel)}"
            text += f"; {self.detail}" if self.detail else ""
        ranks = f" on rank(s) {', '.join(map(str, self.ranks))}" if self.ranks else ""
        return f"{what}{self.key} ({where}){ranks}: {text}"

def compare_all(a: Records, b: Records, section: str, rtol, atol,
                locations: dict | None = None, run_rounding: torch.dtype | None = None,
                last_bits: bool = False, resolved: dict | None = None) -> list[RunEntry]:
    """Every key of ``a`` in ``a``'s order, then the keys only ``b`` has; ``resolved`` collects
    ``{(section, key): (record a, record b)}`` for keys a sharded run resolved (see the module
    docstring)."""
    locations = getattr(a, "locations", {}) if locations is None else locations
    found = []
    for key in a.keys():
        record = a.record(key)
        location = locations.get(key) or locations.get(key.split("/", 1)[0], "")
        if key not in b:
            found.append(RunEntry(key, record.op, location, section, "only a",
                                  shape=shape_text(record.shape), dtype=dtype_text(record.dtype),
                                  detail="only in run a"))
            continue
        found.append(compare_key(record, b.record(key), location, section, rtol, atol,
                                 run_rounding, last_bits, resolved))
    for key in b.keys():
        if key not in a:
            record = b.record(key)
            location = getattr(b, "locations", {}).get(key, "")
            found.append(RunEntry(key, record.op, location, section, "only b",
                                  shape=shape_text(record.shape), dtype=dtype_text(record.dtype),
                                  detail="only in run b"))
    return found


def compare_key(ra: Record, rb: Record, location: str, section: str, rtol,
                atol, run_rounding: torch.dtype | None = None,
                last_bits: bool = False, resolved: dict | None = None) -> RunEntry:
    """One key of two runs, as a :class:`RunEntry`."""
    common: dict[str, Any] = dict(key=ra.key, op=ra.op, location=location, section=section,
                                  shape=shape_text(ra.shape), dtype=dtype_text(ra.dtype))
    if ra.stale or rb.stale:
        which = "a" if ra.stale else "b"
        return RunEntry(status="stale", detail=f"stale in run {which}: written in place after "
                                               f"its capture, not compared", **common)
    for side, this, other in (("a", ra, rb), ("b", rb, ra)):
        if isinstance(this, ShardedRecord) and this.problem() and this.disagrees \
                and not unassembled(other, other):
            found = this.resolve_against(other, rtol, atol)
            if found is not None:
                return _resolved_entry(side, found, ra, rb, common, resolved, rtol, atol)
    if why := unassembled(ra, rb):  # a sharded run (distributed/sharded.py)
        return RunEntry(status="unassembled", detail=why, **common)
    if tuple(ra.shape) != tuple(rb.shape):
        return RunEntry(status="shape", max_abs=math.inf, max_rel=math.inf,
                        detail=f"shape {shape_text(ra.shape)} vs {shape_text(rb.shape)}",
                        **common)
    rtol_d, atol_d = default_tolerances(ra.dtype, rb.dtype)
    rtol = rtol_d if rtol is None else float(rtol)
    atol = atol_d if atol is None else float(atol)
    detail = ("" if ra.dtype == rb.dtype
              else f"dtype {dtype_text(ra.dtype)} vs {dtype_text(rb.dtype)}")
    rounds = rounding_dtype(ra.dtype, rb.dtype) or (
        run_rounding if ra.dtype.is_floating_point and rb.dtype.is_floating_point else None)
    if rounds is not None:
        common["rounding_dtype"] = str(rounds).replace("torch.", "")
    one_dtype = ra.dtype if last_bits and ra.dtype == rb.dtype and ra.dtype.is_floating_point \
        else None
    if ra.value is None or rb.value is None:  # statistics only
        if rounds is not None:
            common["rounding"] = stats_rounding_ratio(ra.stats, rb.stats, rounds)
        if one_dtype is not None:
            common["last_bits"] = stats_rounding_ratio(ra.stats, rb.stats, one_dtype)
        return _compare_stats(ra, rb, rtol, atol, common, detail)
    va, vb = ra.value, rb.value
    if va.dtype != vb.dtype:
        if not (_floating(va) and _floating(vb)):
            return RunEntry(status="shape", max_abs=math.inf, max_rel=math.inf, detail=detail,
                            **common)
        wider = torch.promote_types(va.dtype, vb.dtype)
        va, vb = va.to(wider), vb.to(wider)
    if va.device != vb.device:
        vb = vb.to(va.device)
    if rounds is not None and _floating(va) and not va.is_complex():
        common["rounding"] = rounding_ratio(va, vb, rounds)
    result = compare_tensors(va, vb, ra.key, rtol, atol, equal_nan=True)
    if one_dtype is not None and result.max_abs != 0 and not va.is_complex():
        common["last_bits"] = rounding_ratio(va, vb, one_dtype)
    if result.ok:  # equal: the same dtype and values (NaN where the other has NaN)
        status = "equal" if result.max_abs == 0 and ra.dtype == rb.dtype else "close"
    else:
        status = "differs"
    if not result.ok and result.detail:
        detail = "; ".join(part for part in (detail, result.detail) if part)
    elif status == "differs":
        detail = "; ".join(part for part in (detail, f"{result.mismatched}/{result.numel} "
                                                      f"elements beyond rtol={rtol:g}, "
                                                      f"atol={atol:g}") if part)
    return RunEntry(status=status, max_abs=result.max_abs, max_rel=result.max_rel, detail=detail,
                    **common)


def _floating(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _compare_stats(ra: Record, rb: Record, rtol, atol, common, detail) -> RunEntry:
    sa, sb = ra.stats, rb.stats
    max_abs = max_rel = 0.0
    ok = sa.nonfinite == sb.nonfinite
    for x, y in zip(sa[:4], sb[:4]):
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        diff = abs(y - x)
        diff = math.inf if math.isnan(diff) else diff
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / abs(x) if x else math.inf)
        ok = ok and diff <= atol + rtol * abs(x)
    exact = sa == sb or str(sa) == str(sb)
    status = "equal" if exact else ("close" if ok else "differs")
    what = "statistics compared (mean, std, min, max, non-finite)"
    return RunEntry(status=status, max_abs=max_abs, max_rel=max_rel,
                    detail="; ".join(part for part in (detail, what) if part), **common)


def _resolved_entry(side: str, found, ra: Record, rb: Record, common: dict,
                    resolved: dict | None, rtol, atol) -> RunEntry:
    """The entry of a key whose pieces in run ``side`` were resolved against the other run."""
    resolution, record = found
    if resolved is not None:
        pair = (record, rb) if side == "a" else (ra, record)
        resolved[(common["section"], common["key"])] = pair
    if resolution.value is None:  # statistics: the layout's merged summary against the other's
        pair = (record, rb) if side == "a" else (ra, record)
        rtol_d, atol_d = default_tolerances(ra.dtype, rb.dtype)
        entry = _compare_stats(pair[0], pair[1], rtol_d if rtol is None else float(rtol),
                               atol_d if atol is None else float(atol), dict(common), "")
        status = entry.status if resolution.ok else "differs"
        max_abs, max_rel = entry.max_abs, entry.max_rel
    else:
        exact = resolution.max_abs == 0 and ra.dtype == rb.dtype
        status = "differs" if not resolution.ok else ("equal" if exact else "close")
        max_abs, max_rel = resolution.max_abs, resolution.max_rel
    detail = f"run {side}: {resolution.describe()}"
    if not resolution.ok and resolution.errors:
        detail += f"; {resolution.errors_text()}"
    common = dict(common, shape=shape_text(record.shape if side == "a" else ra.shape))
    return RunEntry(status=status, max_abs=max_abs, max_rel=max_rel, detail=detail,
                    ranks=resolution.ranks, layout=resolution.layout, **common)
