"""Where a step's statistics go besides the folder: a TensorBoard writer, any callable.

Both get the global batch's statistics as ``{"<key>.<kind>.<stat>": value}``: a
``SummaryWriter`` (or anything with ``add_scalar(tag, value, step)``) one scalar per
name, a callable ``fn(step, values)`` the whole dict at once. ``stats`` limits which
stats are sent (default: all of :data:`~fxdebug.monitoring.statistics.STATS`).

>>> seen = []
>>> emit(lambda step, values: seen.append((step, values)), None, 5,
...      {"fc.out": [2.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0, 0.0, 2.0]}, {}, ("mean", "max"))
>>> seen
[(5, {'fc.out.mean': 1.0, 'fc.out.max': 2.0})]
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import FxdebugError
from .statistics import STATS, UPDATE_STATS, derived, split_slot

__all__ = ["emit", "check_stats", "check_writer"]


def check_stats(stats) -> tuple[str, ...]:
    """The stat names to send, checked (``None``: all)."""
    if stats is None:
        return UPDATE_STATS
    chosen = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [s for s in chosen if s not in UPDATE_STATS]
    if unknown:
        raise FxdebugError(f"fxdebug.monitor: unknown stat(s) {unknown} in stats=; the stats are "
                           f"{', '.join(UPDATE_STATS)}.")
    return chosen


def check_writer(writer) -> None:
    """Refuse a ``writer=`` that has no ``add_scalar`` (a path, a callable meant for
    ``callback=``)."""
    if writer is not None and not callable(getattr(writer, "add_scalar", None)):
        raise FxdebugError(
            f"fxdebug.monitor: writer= takes a TensorBoard SummaryWriter (anything with "
            f"add_scalar(tag, value, step)), got {type(writer).__name__}. For a folder pass "
            f"folder=, for a function callback=.")


def values_of(rows: dict[str, Sequence[float]], params: dict[str, Sequence[float]],
              stats: Sequence[str]) -> dict[str, float]:
    """``{"<key>.<kind>.<stat>": value}`` of a step's rows (``update`` rows take their
    ratio from ``params[key]``, the parameters' row of the step they belong to)."""
    out: dict[str, float] = {}
    for name, row in rows.items():
        key, kind = split_slot(name)
        numbers = derived(row, params.get(key) if kind == "update" else None)
        for stat in stats:
            if stat in numbers and (stat in STATS or kind == "update"):
                out[f"{name}.{stat}"] = numbers[stat]
    return out


def emit(callback: Callable | None, writer, step: int, rows: dict[str, Sequence[float]],
         params: dict[str, Sequence[float]], stats: Sequence[str]) -> None:
    """Send one step's global rows to ``callback`` and ``writer`` (either may be None)."""
    if callback is None and writer is None:
        return
    values = values_of(rows, params, stats)
    if writer is not None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
    if callback is not None:
        callback(step, values)
