"""Statistics of a tensor, computed on its device and read once: what stats mode keeps.

A :func:`summarize` call turns a tensor into a *summary*: eight float64 numbers
on the tensor's device, ``(finite count, mean, M2, min, max, zeros, non-finite,
numel)``, where ``M2`` is the sum of squared deviations from the mean over the
finite values. Summaries of several runs merge exactly (:func:`combine`, Chan's
parallel formula), and :func:`stats_from_summary` reads one into :class:`Stats`.

``std`` is what ``tensor.std()`` gives by default: the sample standard
deviation, Bessel-corrected (``sqrt(M2 / (n - 1))`` over the ``n`` finite
values; NaN for a single value, as torch). Tables, saved runs and reports all
show this one.

A float tensor of at least ``MIN_NUMEL`` values (on the CPU ``NATIVE_MIN_NUMEL``,
where the C kernel is built) takes one pass: a kernel (C on
the CPU, compiled by ``torch.compile`` elsewhere) returns its count, mean, M2,
min, max and zero count together (:mod:`.kernel`). No path takes the spread as ``sum(x**2) - n *
mean**2`` where that could cancel: each sums deviations from a shift close to
the values (the kernel's per-row shifts, a first estimate of the mean) and
corrects by their sum, so the error does not depend on the order of the sums.
On the CPU, where reading a number costs nothing, the summary is checked as it
is made, and a slower path runs only where it must: a non-finite value, a
shift far from the values, or float32 overflow (float64). Smaller tensors,
integers, float64, and machines where the kernel cannot be compiled take
torch's own reductions (four passes; masked where values are not finite). On
other devices nothing is read during the run, and the table reads every
summary at once, after the run: a floating CUDA tensor of any size takes two
Triton kernel launches (:mod:`.triton_kernel`; a GPU's cost is the host's time
to launch), other devices the compiled kernel in float64.

>>> s = stats_from_summary(summarize(torch.tensor([1.0, 3.0, float("inf"), 0.0])))
>>> round(s.mean, 4), round(s.std, 4), s.min, s.max, s.zeros_pct, s.nonfinite
(1.3333, 1.5275, 0.0, 3.0, 25.0, 1)
>>> round(torch.tensor([1.0, 3.0, 0.0]).std().item(), 4)
1.5275
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .kernel import BOUND_RATIO, MIN_NUMEL, NATIVE_MIN_NUMEL, ROW, one_pass_sums
from .native import summary as native_summary
from .triton_kernel import GPU_DTYPES, gpu_summary

__all__ = ["Stats", "tensor_stats", "summarize", "combine", "stats_from_summary",
           "stats_from_summaries", "sample_std"]


class Stats(NamedTuple):
    """Summary of one tensor: statistics over its finite values, plus counts.

    ``std`` is Bessel-corrected (n - 1), as ``tensor.std()``; ``norm`` is the
    Frobenius norm of the finite values.
    """

    mean: float
    std: float
    min: float
    max: float
    zeros_pct: float
    nonfinite: int
    numel: int
    norm: float = float("nan")


_NAN = float("nan")
_INF = float("inf")


def _comparable(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` as a floating tensor statistics can be taken of; None where none can."""
    t = tensor.detach()
    if t.is_complex():
        t = t.abs()
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    if not t.is_floating_point():
        return t.to(torch.float64)  # integers and bools: exact in float64
    if t.dtype in (torch.float16, torch.bfloat16) or t.element_size() < 2:
        return t.float()
    return t


def summarize(tensor: torch.Tensor, sync_free: bool | None = None,
              one_pass: bool = True) -> torch.Tensor:
    """The summary of ``tensor``: a float64 tensor of 8 on its device (see the module docstring).

    A DTensor gives its local piece's summary (the caller labels it with its placement).
    ``sync_free`` (default: on every device but the CPU) computes it without
    reading any number back to the host. ``one_pass=False`` uses torch's own
    reductions even where the compiled kernel applies (same statistics; no
    compile on first use, which pays off only over many tensors and runs).

    >>> [round(v, 4) for v in summarize(torch.tensor([0.0, 2.0])).tolist()]
    [2.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0]
    """
    if type(tensor) not in _PLAIN_TENSORS:
        tensor = _local_piece(tensor)
    numel = tensor.numel()
    if sync_free is None:
        sync_free = tensor.device.type != "cpu"
    kernel_applies = one_pass and tensor.layout == torch.strided and type(tensor) in _PLAIN_TENSORS
    if kernel_applies and numel and sync_free and tensor.device.type == "cuda" \
            and tensor.dtype in GPU_DTYPES:
        summary = gpu_summary(tensor)  # two launches, nothing read back
        if summary is not None:
            return summary
    if kernel_applies and numel >= NATIVE_MIN_NUMEL and not sync_free and tensor.is_cpu:
        summary, declined = native_summary(tensor, BOUND_RATIO, ROW)  # dense float32/16/bf16
        if summary is not None:
            return summary
        kernel_applies = not declined  # (the same sums another kernel would find: the exact path)
    if kernel_applies and tensor.dtype in _KERNEL_DTYPES and (
            (numel >= MIN_NUMEL and tensor.device.type == "cuda")
            or (numel >= NATIVE_MIN_NUMEL and tensor.device.type == "cpu")):
        sums = one_pass_sums(tensor, wide=sync_free)
        if sums is not None:
            summary = _from_sums_on_device(sums, numel) if sync_free else _from_sums(sums, numel)
            if summary is not None:
                return summary
    t = _comparable(tensor) if numel else None
    if t is None:  # empty, sparse, quantized, meta: only the size is known
        return torch.tensor([0.0, _NAN, _NAN, _INF, -_INF, _NAN, 0.0, float(numel)],
                            dtype=torch.float64)
    if not sync_free:
        fast = _summarize_finite_cpu(t, numel)
        if fast is not None:
            return fast
    return _summarize_masked(t, numel)


def _local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (torch's ops on a sharded DTensor mix the piece's counts with
    the whole tensor's size): the statistics are this rank's piece's, and the caller, who
    knows the placement, says so. Any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and hasattr(tensor, "placements"):
        return to_local()
    return tensor


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # subclasses take torch's own reductions


def _from_sums(sums: torch.Tensor, numel: int) -> torch.Tensor | None:
    """The summary from the float32 kernel's part; None where it is not exact enough."""
    count, mean, m2, low, high, zeros, bound = sums.tolist()
    # Every value is finite, or a NaN or Inf shows below. The float32 rounding error of m2 is a
    # small multiple of 2**-24 * bound whatever the order of the sums: recompute where bound is
    # large against m2 (a row's shift far from its values), or on a NaN, Inf or float32 overflow.
    if not (math.isfinite(mean) and math.isfinite(m2) and math.isfinite(bound)
            and math.isfinite(low) and math.isfinite(high) and bound <= BOUND_RATIO * m2):
        return None
    return torch.tensor([count, mean, m2, low, high, zeros, 0.0, float(numel)],
                        dtype=torch.float64)


def _from_sums_on_device(sums: torch.Tensor, numel: int) -> torch.Tensor:
    """The summary from the float64 kernel's part, without reading anything back."""
    count, mean, m2, low, high, zeros, _ = sums.unbind()
    mean = torch.where(count > 0, mean, _NAN)
    return torch.stack([count, mean, m2.clamp(min=0), low, high, zeros, numel - count,
                        torch.full_like(count, float(numel))])


def _shifted_m2(t: torch.Tensor, mean: float, numel: int) -> tuple[float, float, float]:
    """``(mean, M2, bound)`` from the deviations of ``t`` from ``mean`` (as ``t``'s dtype holds
    it), corrected by their sum: exact to rounding whatever the order of the sums."""
    shift = torch.tensor(mean, dtype=t.dtype)
    deviation = t - shift
    total = float(deviation.sum())
    bound = float(torch.linalg.vector_norm(deviation)) ** 2
    return float(shift) + total / numel, bound - total * total / numel, bound


def _summarize_finite_cpu(t: torch.Tensor, numel: int) -> torch.Tensor | None:
    """Four passes, when every value is finite (None otherwise); reads numbers as it goes."""
    low, high = (float(v) for v in torch.aminmax(t))
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    total = float(t.sum())
    bound = float(torch.linalg.vector_norm(t)) ** 2
    mean = total / numel
    m2 = bound - numel * mean * mean
    # sum(x**2) - n * mean**2 is off by a few roundings of sum(x**2) (the bound), whatever the
    # order of the sums: kept where that is small against m2, else deviations from the mean,
    # corrected by their sum (each step brings the shift closer to the mean).
    for shifts in range(4):
        if not (math.isfinite(mean) and math.isfinite(bound)):
            if t.dtype != torch.float64:
                return _summarize_finite_cpu(t.double(), numel)  # float32 overflowed; float64 not
            return None  # float64 overflowed too: the masked path scales the deviations
        if bound <= BOUND_RATIO * m2 or (shifts == 3 and t.dtype == torch.float64):
            break
        if shifts == 3:  # the values lie too close together for a float32 shift
            return _summarize_finite_cpu(t.double(), numel)
        mean, m2, bound = _shifted_m2(t, mean, numel)
    zeros = numel - int(torch.count_nonzero(t))
    return torch.tensor([float(numel), mean, max(m2, 0.0), low, high, float(zeros), 0.0,
                         float(numel)], dtype=torch.float64)


def _summarize_masked(t: torch.Tensor, numel: int) -> torch.Tensor:
    """Statistics over the finite values, entirely on the device (nothing read back)."""
    finite = torch.isfinite(t)
    count = finite.sum().to(torch.float64)
    safe = count.clamp(min=1)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    mean = torch.where(finite, t, zero).sum(dtype=torch.float64) / safe
    low = torch.where(finite, t, torch.full_like(zero, _INF)).amin().to(torch.float64)
    high = torch.where(finite, t, torch.full_like(zero, -_INF)).amax().to(torch.float64)
    # Deviations from the float64 mean, scaled by the largest magnitude so their squares cannot
    # overflow, and corrected by their sum.
    scale = torch.maximum(low.abs(), high.abs())
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    deviation = torch.where(finite, (t.double() - mean) / scale, 0.0)
    total = deviation.sum()
    m2 = ((torch.linalg.vector_norm(deviation).square() - total * total / safe)
          * scale.square()).clamp(min=0)
    mean = mean + total * scale / safe
    zeros = numel - torch.count_nonzero(t).to(torch.float64)
    nonfinite = numel - count
    return torch.stack([count, mean, m2, low, high, zeros, nonfinite,
                        torch.full_like(count, float(numel))])


def combine(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The summary of two tensors' values together (Chan et al.'s parallel formula).

    Summaries may be stacked: rows of ``first`` merge with the rows of ``second``.

    >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0, 4.0])
    >>> both = stats_from_summary(combine(summarize(a), summarize(b)))
    >>> whole = stats_from_summary(summarize(torch.cat([a, b])))
    >>> [round(x, 6) for x in both] == [round(x, 6) for x in whole]
    True
    """
    second = second.to(first.device)
    n_a, n_b = first[..., 0], second[..., 0]
    count = n_a + n_b
    safe = count.clamp(min=1)
    mean_a = torch.where(n_a > 0, first[..., 1], 0.0)
    mean_b = torch.where(n_b > 0, second[..., 1], 0.0)
    delta = mean_b - mean_a
    mean = mean_a + delta * n_b / safe
    m2 = (torch.where(n_a > 0, first[..., 2], 0.0) + torch.where(n_b > 0, second[..., 2], 0.0)
          + delta * delta * n_a * n_b / safe)
    return torch.stack([count, mean, m2, torch.minimum(first[..., 3], second[..., 3]),
                        torch.maximum(first[..., 4], second[..., 4]),
                        first[..., 5] + second[..., 5], first[..., 6] + second[..., 6],
                        first[..., 7] + second[..., 7]], dim=-1)


def _stats(values: list[float]) -> Stats:
    count, mean, m2, low, high, zeros, nonfinite, numel = values
    zeros_pct = 100.0 * zeros / numel if numel else _NAN
    if count == 0:
        return Stats(_NAN, _NAN, _NAN, _NAN, zeros_pct, int(nonfinite), int(numel))
    m2 = max(m2, 0.0)
    return Stats(mean, sample_std(m2, count), low, high, zeros_pct, int(nonfinite), int(numel),
                 math.sqrt(max(m2 + count * mean * mean, 0.0)))


def sample_std(m2: float, count: float) -> float:
    """The Bessel-corrected std from ``M2`` over ``count`` values, as ``tensor.std()`` (NaN for one).

    >>> round(sample_std(2.0, 2), 4), sample_std(0.0, 1)
    (1.4142, nan)
    """
    return math.sqrt(m2 / (count - 1)) if count > 1 else _NAN


def stats_from_summary(summary: torch.Tensor) -> Stats:
    """Read a summary (one host read) into :class:`Stats`."""
    return _stats(summary.tolist())


def stats_from_summaries(summaries: list[torch.Tensor]) -> list[Stats]:
    """Read many summaries with one host read per device.

    >>> [s.max for s in stats_from_summaries([summarize(torch.ones(2)), summarize(torch.zeros(1))])]
    [1.0, 0.0]
    """
    by_device: dict[str, list[int]] = {}
    for index, summary in enumerate(summaries):
        by_device.setdefault(str(summary.device), []).append(index)
    out: list[Stats | None] = [None] * len(summaries)
    for indices in by_device.values():
        rows = torch.stack([summaries[i] for i in indices]).tolist()
        for index, row in zip(indices, rows):
            out[index] = _stats(row)
    return out  # type: ignore[return-value]


def tensor_stats(tensor: torch.Tensor) -> Stats:
    """Mean, std (n - 1, as ``tensor.std()``), min, max over the finite values; % zeros;
    non-finite count.

    For one tensor at a time (a table of kept values, a report): torch's own
    reductions, no compiled kernel (stats mode's runs use that, see :func:`summarize`).

    >>> s = tensor_stats(torch.tensor([1.0, 3.0, float("inf"), 0.0]))
    >>> round(s.mean, 4), round(s.std, 4), s.min, s.max, s.zeros_pct, s.nonfinite
    (1.3333, 1.5275, 0.0, 3.0, 25.0, 1)
    """
    return stats_from_summary(summarize(tensor, one_pass=False))
