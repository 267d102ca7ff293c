"""The statistics a monitor reports, read from a moment summary, and the names they go by.

A series is named ``<key>.<kind>.<stat>``: ``key`` a module path (a capture key, with
``/0``... for the parts of a nested output), ``kind`` one of :data:`KINDS`, ``stat`` one
of :data:`STATS` (``update`` adds ``ratio``). Every stat comes from the ten numbers of
:mod:`fxdebug.runtime.stats_moments`, so those are what a folder keeps, and any stat
of any step (or of several ranks merged) can be computed again from them.

>>> row = [4.0, 4.0, 50.0, 1.0, 10.0, 0.0, 0.0, 4.0, 180.0, 1394.0]
>>> s = derived(row)
>>> s["mean"], round(s["std"], 4), s["absmax"], round(s["rms"], 4), round(s["kurtosis"], 4)
(4.0, 4.0825, 10.0, 5.3385, 2.2304)
"""

from __future__ import annotations

import math
from typing import Sequence

from ..runtime.stats import sample_std

__all__ = ["KINDS", "STATS", "UPDATE_STATS", "derived", "slot", "split_slot"]

KINDS = ("out", "grad", "param", "param_grad", "update")
"""What a key's statistics are of: its forward output, the gradient of that output, the
module's own parameters (pooled), their gradients, and the change the optimizer made."""

STATS = ("count", "mean", "std", "min", "max", "absmax", "rms", "norm", "zeros_pct", "nonfinite",
         "kurtosis")
"""Every kind's statistics: ``count`` finite values, ``std`` Bessel-corrected (as
``tensor.std()``), ``rms`` and ``norm`` (L2) of the finite values, ``zeros_pct`` of all
values, ``nonfinite`` NaN and Inf count, ``kurtosis`` Pearson's (3 for a normal distribution)."""

UPDATE_STATS = STATS + ("ratio",)
"""``update`` also has ``ratio``: the update's rms over the parameters' rms before it."""

_NAN = float("nan")


def derived(row: Sequence[float], param_row: Sequence[float] | None = None) -> dict[str, float]:
    """``{stat: value}`` of one moment summary (``ratio`` too when ``param_row`` is given).

    >>> derived([0.0] + [float("nan")] * 4 + [0.0, 2.0, 2.0, float("nan"), float("nan")])["nonfinite"]
    2.0
    """
    count, mean, m2, low, high, zeros, nonfinite, numel, m3, m4 = (float(v) for v in row)
    del m3
    out = dict.fromkeys(STATS, _NAN)
    out.update(count=count, nonfinite=nonfinite,
               zeros_pct=100.0 * zeros / numel if numel else _NAN)
    if count > 0:
        m2 = max(m2, 0.0)
        squares = max(m2 + count * mean * mean, 0.0)
        out.update(mean=mean, std=sample_std(m2, count), min=low, max=high,
                   absmax=max(abs(low), abs(high)), rms=math.sqrt(squares / count),
                   norm=math.sqrt(squares),
                   kurtosis=count * m4 / (m2 * m2) if m2 > 0 else _NAN)
    if param_row is not None:
        reference = derived(param_row)["rms"]
        out["ratio"] = out["rms"] / reference if reference and math.isfinite(reference) else _NAN
    return out


def slot(key: str, kind: str) -> str:
    """The name of a key's summary of one kind: ``<key>.<kind>``.

    >>> slot("fc1", "param_grad")
    'fc1.param_grad'
    """
    return f"{key}.{kind}"


def split_slot(name: str) -> tuple[str, str]:
    """``(key, kind)`` of ``<key>.<kind>`` (keys hold dots themselves; kinds never do).

    >>> split_slot("layer1.0.conv1.grad")
    ('layer1.0.conv1', 'grad')
    """
    key, _, kind = name.rpartition(".")
    return key, kind
