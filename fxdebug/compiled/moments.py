"""Moment summaries as graph ops: the training monitor's ten numbers inside ``torch.compile``.

:func:`graph_moments` is :func:`fxdebug.stats.moments.summarize_moments` written as plain torch ops
(no branch on a value, no host read), so dynamo puts it in the graph and inductor compiles it
into the kernels that read the value anyway::

    count, mean, M2, min, max, zeros, non-finite, numel, M3, M4

A float32, float16 or bfloat16 tensor of :data:`~fxdebug.runtime.compiled_stats.FLOAT32_MIN_NUMEL` values or
more takes one float32 pass, as stats mode's :func:`~fxdebug.runtime.compiled_stats.graph_summary`: the
deviations ``d`` from a shift (a trimmed mean of a few values), scaled by 1 / those values'
largest magnitude, summed with their squares, cubes and fourth powers; the central moments follow
from these power sums. ``M2`` is kept where the squares are at most
:data:`~fxdebug.runtime.compiled_stats.FLOAT32_RATIO` times it (as stats mode), ``M4`` where that holds and the
fourth powers are finite and at most :data:`FLOAT32_RATIO4` times it, ``M3`` where ``M2`` is:
NaN elsewhere, never an imprecise number (a shift within a few standard deviations of the mean,
which the ``M2`` test implies, bounds the fourth powers by some 330 ``M4``). Other tensors take two
float64 passes (the mean, then the deviations from it, scaled by the largest magnitude).

>>> s = graph_moments(torch.tensor([1.0, 2.0, 3.0, 10.0]))
>>> [round(v, 4) for v in s.tolist()]
[4.0, 4.0, 50.0, 1.0, 10.0, 0.0, 0.0, 4.0, 180.0, 1394.0]
"""

from __future__ import annotations

import torch

from ..runtime.compiled_stats import (FLOAT32_MIN_NUMEL, FLOAT32_RATIO, _always, _counter, _finite,
                                      _trimmed_picks, scaled_deviations)

__all__ = ["graph_moments", "FLOAT32_RATIO4"]

FLOAT32_RATIO4 = 512.0
"""float32's ``M4`` is kept where the fourth powers of the deviations from the shift are at most
this many times ``M4``."""

_INF = float("inf")
_TINY = 2.0 ** -126
_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def graph_moments(tensor: torch.Tensor) -> torch.Tensor:
    """The moment summary of ``tensor`` (10 float64 numbers) as graph ops.

    >>> from fxdebug.stats.moments import summarize_moments
    >>> x = torch.randn(5000)
    >>> torch.allclose(graph_moments(x), summarize_moments(x), rtol=1e-4)
    True
    """
    value = tensor.detach()
    if value.is_complex():
        value = value.abs()
    if value.dtype in _NARROW and _always(value.numel() >= FLOAT32_MIN_NUMEL):
        return _float32_moments(value)
    return _float64_moments(value)


def _central(count, total, squares, cubes, fourths):
    """``(M2, M3, M4)`` of values whose deviations from a shift have these power sums."""
    safe = count.clamp(min=1)
    mu = total / safe
    m2 = (squares - total * mu).clamp(min=0)
    m3 = cubes - 3.0 * mu * squares + 2.0 * count * mu * mu * mu
    m4 = (fourths - 4.0 * mu * cubes + 6.0 * mu * mu * squares
          - 3.0 * count * mu * mu * mu * mu).clamp(min=0)
    return m2, m3, m4


def _float32_moments(value: torch.Tensor) -> torch.Tensor:
    wide = value.float()
    shift, scale = _trimmed_picks(wide)
    finite = _finite(wide)
    d = torch.where(finite, (wide - shift) * scale, 0.0)
    d2 = d * d
    total = d.sum().double()
    squares = d2.sum().double()
    cubes = (d2 * d).sum().double()
    fourths = (d2 * d2).sum().double()
    counter = _counter(value)
    count = finite.sum(dtype=counter).double()
    low = torch.where(finite, wide, _INF).amin().double()
    high = torch.where(finite, wide, -_INF).amax().double()
    zeros = (wide == 0).sum(dtype=counter).double()
    m2, m3, m4 = _central(count, total, squares, cubes, fourths)
    same = low == high
    sums_finite = torch.isfinite(total + squares + cubes + fourths)
    precise = (sums_finite & (squares <= FLOAT32_RATIO * m2)
               & ((squares >= count * _TINY) | same))
    precise4 = precise & (fourths <= FLOAT32_RATIO4 * m4) & ((fourths >= count * _TINY) | same)
    unscale = 1.0 / scale.double()
    u2 = unscale * unscale
    nan = float("nan")
    m2 = torch.where(precise, m2 * u2, nan)
    m3 = torch.where(precise, m3 * u2 * unscale, nan)
    m4 = torch.where(precise4, m4 * u2 * u2, nan)
    safe = count.clamp(min=1)
    mean = torch.where((count > 0) & sums_finite & precise, shift.double() + total * unscale / safe,
                       nan)
    numel = torch.full_like(count, value.numel())
    return torch.stack([count, mean, m2, low, high, zeros, numel - count, numel, m3, m4])


def _float64_moments(value: torch.Tensor) -> torch.Tensor:
    wide = value.to(torch.float64)
    count, safe, first, low, high, scale, d = scaled_deviations(wide)
    d2 = d * d
    total = d.sum()
    m2, m3, m4 = _central(count, total, d2.sum(), (d2 * d).sum(), (d2 * d2).sum())
    s2 = scale * scale
    zeros = (wide == 0).sum().to(torch.float64)
    mean = torch.where(count > 0, first + total * scale / safe, float("nan"))
    numel = torch.full_like(count, value.numel())
    return torch.stack([count, mean, m2 * s2, low, high, zeros, numel - count, numel,
                        m3 * s2 * scale, m4 * s2 * s2])
