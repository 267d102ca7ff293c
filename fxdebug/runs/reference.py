"""Rounding is not a bug: judge run ``b`` against run ``a`` by their errors against a reference.

Another parallelism (tensor parallel, a sharded reduction, another kernel)
adds floating-point numbers in another order, so its values differ from an
unsharded run's in their last bits at every key, and more so in bfloat16.
Given a reference run ``r`` of the same model and input in a more precise dtype
(typically float64), each key's error is measured against it::

    err(x, r) = ||x - r|| / ||r||        (Frobenius norms, computed in float64)

and run ``b`` diverges at a key only where it is clearly worse than run ``a``::

    err(b, r)  >  factor * err(a, r) + floor

``factor`` (``REFERENCE_FACTOR`` = 4) and ``floor`` (``REFERENCE_FLOOR_EPS`` = 2
eps of b's dtype at that key) come from measurement: against a float64 run, a
correct change of reduction order gave ``err(b, r) / err(a, r)`` up to 2.9 (a
bfloat16 MLP whose Linears sum 32 partial matmuls) and 2.6 (a float32 resnet18
in channels_last); where ``a`` rounds little (weights and input exact in
bfloat16) the ratio reached 4.5 with ``err(b, r)`` under 1 eps, which the floor
covers. A weight scaled by 1.01 gave 26000 in float32; in bfloat16 the same 1 %
change gives only 2.2 (1.3 eps), below what another reduction order can give
(1.7 eps): in bfloat16 a change smaller than a few percent at a key cannot be
told from rounding.

Statistics-only captures (``mode="stats"``) use the largest error of the mean,
std, min and max against the reference's scale ``max(|min|, |max|, |mean| + std)``.
One number's error is noisy (a's may be near zero by chance: ratios up to 14
were measured for correct runs, with ``err(b, r)`` up to 15 eps in float32), so
their floor is ``STATS_FLOOR_EPS`` = 16 eps.

>>> r = torch.linspace(1, 2, 100, dtype=torch.float64)
>>> a, b = r.float(), r.bfloat16()
>>> relative_error(a, r) < 1e-7 < relative_error(b, r) < 2 ** -8
True
>>> round(relative_error(r * 1.5, r), 12)
0.5
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import ReferenceMismatchError
from ..runtime.records import Record, Records

__all__ = ["REFERENCE_FACTOR", "REFERENCE_FLOOR_EPS", "STATS_FLOOR_EPS", "relative_error", "stats_error",
           "reference_errors", "reference_floor", "check_reference_keys", "ReferenceCheck",
           "LastBits"]

REFERENCE_FACTOR = 4.0
"""Run b diverges at a key where its error against the reference exceeds this many times a's."""

REFERENCE_FLOOR_EPS = 2.0
"""... plus this many ``eps`` of b's dtype at that key (errors near zero are not compared)."""

STATS_FLOOR_EPS = 16.0
"""The floor for statistics-only captures: one statistic's error is noisier than a tensor's."""


def _eps(dtype: torch.dtype | None) -> float:
    return torch.finfo(dtype).eps if dtype is not None and dtype.is_floating_point else 0.0


def relative_error(x: torch.Tensor, r: torch.Tensor) -> float:
    """``||x - r|| / ||r||`` (Frobenius, in float64) over the values finite in both; inf where
    a NaN or Inf of one is not the same in the other, or where ``r`` is zero and ``x`` is not.

    >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0 + 1e-3])) < 2.1e-4
    True
    """
    wide = torch.complex128 if x.is_complex() or r.is_complex() else torch.float64
    x, r = x.detach().to(wide), r.detach().to(device=x.device, dtype=wide)
    finite_x, finite_r = torch.isfinite(x), torch.isfinite(r)
    both = finite_x & finite_r
    same = (x == r) | (torch.isnan(x) & torch.isnan(r))
    if bool((~both & ~same).any()):
        return math.inf
    error = float(torch.linalg.vector_norm(torch.where(both, x - r, 0.0)))
    size = float(torch.linalg.vector_norm(torch.where(both, r, 0.0)))
    if error == 0.0:
        return 0.0
    return error / size if size > 0 else math.inf


def stats_error(x, r) -> float:
    """For statistics-only captures: the largest ``|x - r|`` of mean, std, min and max over the
    reference's scale ``max(|min|, |max|, |mean| + std)``; inf where non-finite counts differ.

    >>> from fxdebug.stats.summary import tensor_stats
    >>> r = tensor_stats(torch.tensor([1.0, 2.0, 4.0]))
    >>> stats_error(tensor_stats(torch.tensor([1.0, 2.0, 4.4])), r) > 0.09
    True
    """
    if x.nonfinite != r.nonfinite:
        return math.inf
    parts = [abs(v) for v in (r.min, r.max) if not math.isnan(v)]
    if not math.isnan(r.mean):
        parts.append(abs(r.mean) + (0.0 if math.isnan(r.std) else r.std))
    scale = max(parts, default=0.0)
    worst = 0.0
    for u, v in zip(x[:4], r[:4]):
        if u == v or (math.isnan(u) and math.isnan(v)):
            continue
        difference = abs(u - v)
        worst = max(worst, math.inf if math.isnan(difference) else difference)
    if worst == 0.0:
        return 0.0
    return worst / scale if scale > 0 else math.inf


def reference_errors(ra: Record, rb: Record, rr: Record) -> tuple[float, float, bool]:
    """``(err(a, r), err(b, r), by statistics)``: tensors when all three runs kept them, else
    their statistics.

    >>> import fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
    >>> _ = gm(torch.tensor([1.0, 2.0])); r = fxdebug.records(gm).record("0")
    >>> _ = gm(torch.tensor([1.0, 2.5])); b = fxdebug.records(gm).record("0")
    >>> reference_errors(r, b, r)
    (0.0, 0.22360679774997896, False)
    """
    if ra.value is None or rb.value is None or rr.value is None:
        return stats_error(ra.stats, rr.stats), stats_error(rb.stats, rr.stats), True
    return relative_error(ra.value, rr.value), relative_error(rb.value, rr.value), False


def reference_floor(dtype: torch.dtype | None, floor: float | None,
                    by_stats: bool = False) -> float:
    """The floor for a key of ``dtype`` in run b: ``floor`` as given, else 2 eps of ``dtype``
    (16 eps when judged by statistics).

    >>> reference_floor(torch.bfloat16, None), reference_floor(torch.bfloat16, 0.01)
    (0.015625, 0.01)
    """
    if floor is not None:
        return float(floor)
    return (STATS_FLOOR_EPS if by_stats else REFERENCE_FLOOR_EPS) * _eps(dtype)


def check_reference_keys(a: Records, b: Records, r: Records, section: str) -> list[str]:
    """Keys that runs a and b share (``a``'s order); raises when ``r`` lacks one of them or
    holds another shape, as a reference of another model, input or capture selection would.

    >>> import fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> _ = gm(torch.ones(1, 2)); rec = fxdebug.records(gm)
    >>> check_reference_keys(rec, rec, rec, "forward")
    ['0']
    """
    shared = [key for key in a.keys() if key in b]
    what = "gradient keys" if section == "grad" else "keys"
    missing = [key for key in shared if key not in r]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ReferenceMismatchError(
            f"compare_runs: the reference run lacks {len(missing)} of the {len(shared)} {what} "
            f"runs a and b share (first: {shown}). Record the reference from the same model "
            f"and input with the same instrument(capture=..., depth=..., grads=...) as a and b.")
    for key in shared:
        want, got = tuple(a.record(key).shape), tuple(r.record(key).shape)
        if want != got:
            raise ReferenceMismatchError(
                f"compare_runs: {'gradient of ' if section == 'grad' else ''}{key} has shape "
                f"{list(got)} in the reference run but {list(want)} in run a: the reference must "
                f"be a run of the same (unsharded) model on the same input.")
    return shared


@dataclasses.dataclass(frozen=True)
class ReferenceCheck:
    """How run b was judged against run a by their errors against the reference run.

    ``beyond``: the keys where ``err(b, r) > factor * err(a, r) + floor``, in order;
    ``largest``: the largest ``err(b, r) / bound`` among the keys within (at most 1: how near
    the nearest key came to diverging), and its key. A ratio ``err(b, r) / err(a, r)`` is no
    measure there: where run a is exact at a key, any rounding of b makes it huge.
    """

    path: str
    dtype: str
    factor: float
    floor: float | None
    floor_text: str
    checked: int
    beyond: list[str]
    largest: tuple[float, str] | None = None

    @property
    def explained(self) -> bool:
        return not self.beyond

    def rule_text(self) -> str:
        return f"err(b,r) > {self.factor:g} x err(a,r) + {self.floor_text}"

    def describe(self) -> list[str]:
        """The reference, what an error is, the rule and the verdict: lines to fit a width."""
        worst = "" if self.largest is None else \
            f"; closest to the bound: {self.largest[1]} at {self.largest[0]:.2g} of it"
        verdict = (f"reference: every difference in the {self.checked} keys is rounding"
                   f"{worst}" if self.explained else
                   f"reference: {len(self.beyond)} of the {self.checked} keys are beyond "
                   f"rounding: b is further from r than a is")
        return [f"reference: r = {self.path} ({self.dtype} run)",
                "reference: err(x,r) = ||x - r|| / ||r|| (Frobenius, in float64)",
                f"reference: a key diverges where {self.rule_text()}", verdict]


@dataclasses.dataclass(frozen=True)
class LastBits:
    """Without a reference: the keys of one dtype in both runs that differ, and how many of them
    by no more than ``factor`` eps of their norm, as another reduction order can."""

    differing: int
    within: int
    factor: float
    largest: tuple[float, str] | None = None

    def describe(self) -> str:
        worst = "" if self.largest is None else \
            f" (largest {self.largest[0]:.2g} eps, at {self.largest[1]})"
        return (f"last bits: {self.within} of the {self.differing} keys that differ (one dtype in "
                f"both runs) differ by at most {self.factor:g} x eps x norm{worst}: that may be "
                f"rounding of another reduction order; compare_runs(a, b, "
                f"reference=float64_run) tells rounding from a bug")
