"""Can the rounding of a lower-precision dtype explain a difference between two runs?

A float32 run and a bfloat16 run of the same model differ at every key, by
rounding alone, and a real change (a BatchNorm's statistics, a wrong
epsilon) differs at every key after it too: tolerances guessed per dtype tell
the two apart badly. Here each key's difference is measured against what the
lower precision can explain::

    error norm ||a - b||  <=  ROUNDING_FACTOR * eps(dtype) * ||a||

(``eps``: ``torch.finfo(dtype).eps``, 2**-7 for bfloat16; ``ROUNDING_FACTOR``
allows rounding in every layer to add up: a float32 and a bfloat16 resnet18
differ by about 1 eps in eval mode and up to 10 in training mode, where
BatchNorm over few values amplifies it). A real change of a few percent or
more lies beyond; a smaller one can hide in rounding, and only a float64
reference run tells it apart.

>>> a = torch.linspace(1, 2, 100)
>>> rounding_ratio(a, a.bfloat16().float(), torch.bfloat16) < 1
True
>>> rounding_ratio(a, a * 1.5, torch.bfloat16) > ROUNDING_FACTOR   # 50% more: 64 eps
True
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["ROUNDING_FACTOR", "rounding_dtype", "rounding_ratio", "stats_rounding_ratio",
           "RoundingCheck"]

ROUNDING_FACTOR = 16.0
"""Differences within this many ``eps(dtype) * ||a||`` are what rounding can explain."""


def _eps(dtype: torch.dtype | None) -> float:
    return torch.finfo(dtype).eps if dtype is not None and dtype.is_floating_point else 0.0


def rounding_dtype(*dtypes: torch.dtype | None) -> torch.dtype | None:
    """The least precise floating dtype among ``dtypes`` when they are not all the same, else None.

    >>> rounding_dtype(torch.float32, torch.bfloat16), rounding_dtype(torch.float32, torch.float32)
    (torch.bfloat16, None)
    """
    floating = [d for d in dtypes if d is not None and d.is_floating_point]
    if len(set(floating)) < 2:
        return None
    return max(floating, key=lambda d: (_eps(d), str(d)))


def rounding_ratio(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """``||a - b|| / (eps(dtype) * ||a||)`` over the values finite in both (inf where NaN/Inf differ)."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    error = float(torch.linalg.vector_norm(torch.where(finite, a - b, 0.0)))
    size = float(torch.linalg.vector_norm(torch.where(finite, a, 0.0)))
    if error == 0.0:
        return 0.0
    return error / (_eps(dtype) * size) if size > 0 else math.inf


def stats_rounding_ratio(a, b, dtype: torch.dtype) -> float:
    """The same for statistics-only captures: mean, std, min, max against the values' scale."""
    if a.nonfinite != b.nonfinite:
        return math.inf
    scale = max(abs(a.min), abs(a.max), abs(a.mean) + (0.0 if math.isnan(a.std) else a.std))
    worst = 0.0
    for x, y in zip(a[:4], b[:4]):
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        worst = max(worst, abs(x - y) if not math.isnan(x - y) else math.inf)
    if worst == 0.0:
        return 0.0
    return worst / (_eps(dtype) * scale) if scale > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class RoundingCheck:
    """Whether the rounding of ``dtype`` explains every difference found (``beyond``: the keys
    it cannot explain, in order; ``largest``: the largest ratio within, and its key)."""

    dtype: str
    eps: float
    beyond: list[str]
    checked: int
    largest: tuple[float, str] | None = None
    first_beyond: str = ""

    @property
    def explained(self) -> bool:
        return not self.beyond

    def bound_text(self) -> str:
        return (f"error norm <= {ROUNDING_FACTOR:g} x eps({self.dtype}) x norm in run a "
                f"= {ROUNDING_FACTOR * self.eps:.3g} x norm")

    def describe(self) -> str:
        """Whether rounding explains it all, with the bound (one line to fit a width)."""
        if self.explained:
            worst = "" if self.largest is None else \
                f"; largest {self.largest[0]:.2g} eps, at {self.largest[1]}"
            return (f"rounding: {self.dtype} rounding can explain every difference in the "
                    f"{self.checked} keys compared across dtypes ({self.bound_text()}{worst})")
        return (f"rounding: {self.dtype} rounding cannot explain {len(self.beyond)} of the "
                f"{self.checked} keys compared across dtypes ({self.bound_text()})")
