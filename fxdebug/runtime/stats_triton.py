"""A CUDA tensor's summary in two kernel launches, written in Triton.

On a GPU most of what a summary costs is the host's time to launch it, not the
GPU's to read the values: torch's reductions take about 25 launches a tensor,
the ``torch.compile``'d kernel of :mod:`.stats_kernel` about 19 plus its
guards (docs/benchmarks.md, "On a GPU", has the host time of each, measured).
Here a summary is two launches, and nothing is read back::

    gpu_summary(tensor)                  float16/bfloat16/float32/float64, on a CUDA device
      ├─ _block_kernel   one program per BLOCK values, held in registers:
      │                  finite count, their mean, M2 about that mean (two passes
      │                  over the registers, float64, corrected by the deviations'
      │                  sum), min, max, zeros           -> one row of 6 per block
      └─ _combine_kernel one program: the rows merged exactly, in float64,
                         mean = Σ n_b m_b / N, M2 = Σ M2_b + Σ n_b (m_b - mean)²
                         -> [count, mean, M2, min, max, zeros, non-finite, numel]

No sum of squares is ever taken about a far-away shift, so a large mean and a
small spread do not cancel; statistics are over the finite values, as in
:mod:`.stats`. The order of every sum is fixed: the same tensor gives the same
summary, bit for bit. Triton ships with torch's CUDA builds; where it is
missing or cannot build the kernels, :func:`gpu_summary` warns once and
returns None, and stats mode uses the other paths. ``FXDEBUG_STATS_KERNEL=0``
turns it off too.

With ``TRITON_INTERPRET=1`` (set before triton is imported) the same kernels
run on CPU tensors, which is how the tests check them where no GPU is lent.
"""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext
import warnings
from typing import Any

import torch

from ..errors import PerformanceWarning
from .stats_kernel import dense_memory
from .stats_native import kernels_turned_off

__all__ = ["gpu_summary", "GPU_DTYPES"]

GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BLOCK = 2048  # values per program of the first kernel
_COMBINE_BLOCK = 1024  # rows per step of the second kernel's loop
_ROW = 6  # count, mean, M2, min, max, zeros

_kernels: list[tuple[Any, Any]] = []  # Triton's JITFunctions (launched as kernel[grid](...))
_unavailable: list[str] = []
_lock = threading.Lock()


def _build():
    """The two kernels, compiled by Triton on first launch (and cached by it on disk)."""
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]

    @triton.jit(do_not_specialize=["numel"])
    def _block_kernel(x_ptr, rows_ptr, numel, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float64)
        finite = inside & (x == x) & (tl.abs(x) < float("inf"))
        count = tl.sum(finite.to(tl.float64), axis=0)
        safe = tl.maximum(count, 1.0)
        mean = tl.sum(tl.where(finite, x, 0.0), axis=0) / safe
        deviation = tl.where(finite, x - mean, 0.0)
        total = tl.sum(deviation, axis=0)
        m2 = tl.sum(deviation * deviation, axis=0) - total * total / safe
        low = tl.min(tl.where(finite, x, float("inf")), axis=0)
        high = tl.max(tl.where(finite, x, -float("inf")), axis=0)
        zeros = tl.sum((inside & (x == 0.0)).to(tl.float64), axis=0)
        row = rows_ptr + pid.to(tl.int64) * 6
        tl.store(row, count)
        tl.store(row + 1, mean + total / safe)
        tl.store(row + 2, tl.maximum(m2, 0.0))
        tl.store(row + 3, low)
        tl.store(row + 4, high)
        tl.store(row + 5, zeros)

    @triton.jit(do_not_specialize=["numel", "rows"])
    def _combine_kernel(rows_ptr, out_ptr, rows, numel, BLOCK: tl.constexpr):
        index = tl.arange(0, BLOCK)
        count = tl.zeros((BLOCK,), dtype=tl.float64)
        weighted = tl.zeros((BLOCK,), dtype=tl.float64)
        low = tl.full((BLOCK,), float("inf"), dtype=tl.float64)
        high = tl.full((BLOCK,), -float("inf"), dtype=tl.float64)
        zeros = tl.zeros((BLOCK,), dtype=tl.float64)
        start = 0
        while start < rows:  # (a while loop: Triton's interpreter before 3.6 cannot range())
            r = start + index
            used = r < rows
            row = rows_ptr + r.to(tl.int64) * 6
            n = tl.load(row, mask=used, other=0.0)
            count += n
            weighted += n * tl.load(row + 1, mask=used & (n > 0), other=0.0)
            low = tl.minimum(low, tl.load(row + 3, mask=used, other=float("inf")))
            high = tl.maximum(high, tl.load(row + 4, mask=used, other=-float("inf")))
            zeros += tl.load(row + 5, mask=used, other=0.0)
            start += BLOCK
        total = tl.sum(count, axis=0)
        safe = tl.maximum(total, 1.0)
        mean = tl.sum(weighted, axis=0) / safe
        m2 = tl.zeros((BLOCK,), dtype=tl.float64)
        drift = tl.zeros((BLOCK,), dtype=tl.float64)
        start = 0
        while start < rows:
            r = start + index
            used = r < rows
            row = rows_ptr + r.to(tl.int64) * 6
            n = tl.load(row, mask=used, other=0.0)
            gap = tl.where(n > 0, tl.load(row + 1, mask=used, other=0.0) - mean, 0.0)
            m2 += tl.load(row + 2, mask=used, other=0.0) + n * gap * gap
            drift += n * gap
            start += BLOCK
        drift_sum = tl.sum(drift, axis=0)
        m2_sum = tl.sum(m2, axis=0) - drift_sum * drift_sum / safe
        mean = mean + drift_sum / safe
        tl.store(out_ptr, total)
        tl.store(out_ptr + 1, tl.where(total > 0, mean, float("nan")))
        tl.store(out_ptr + 2, tl.maximum(m2_sum, 0.0))
        tl.store(out_ptr + 3, tl.min(low, axis=0))
        tl.store(out_ptr + 4, tl.max(high, axis=0))
        tl.store(out_ptr + 5, tl.sum(zeros, axis=0))
        tl.store(out_ptr + 6, numel - total)
        tl.store(out_ptr + 7, numel * 1.0)

    return _block_kernel, _combine_kernel


def gpu_summary(tensor: torch.Tensor) -> torch.Tensor | None:
    """``[count, mean, M2, min, max, zeros, non-finite, numel]`` of a floating tensor, float64, on
    its device, from two kernel launches and no read back; None where Triton is off or missing.

    >>> summary = gpu_summary(torch.tensor([1.0, 3.0, float("nan"), 0.0]))   # a CPU tensor
    >>> summary is None or summary.tolist() == [3.0, 4 / 3, 14 / 3, 0.0, 3.0, 1.0, 1.0, 4.0]
    True
    """
    if _unavailable or kernels_turned_off():
        return None
    if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if not _kernels:
        with _lock:
            if not _kernels and not _unavailable:
                try:
                    _kernels.append(_build())
                except Exception as error:  # noqa: BLE001 - no triton, or a broken one: say why once
                    _give_up(error)
                    return None
    if _unavailable:
        return None
    block_kernel, combine_kernel = _kernels[0]
    values = dense_memory(tensor.detach())
    numel = values.numel()
    programs = max(-(-numel // BLOCK), 1)
    rows = torch.empty((programs, _ROW), dtype=torch.float64, device=values.device)
    out = torch.empty(8, dtype=torch.float64, device=values.device)
    try:
        with torch.cuda.device(values.device) if values.device.type == "cuda" else nullcontext():
            block_kernel[(programs,)](values, rows, numel, BLOCK=BLOCK)
            combine_kernel[(1,)](rows, out, programs, numel, BLOCK=_COMBINE_BLOCK)
    except Exception as error:  # noqa: BLE001 - a kernel that does not build here: say why once
        _give_up(error)
        return None
    return out


def _give_up(error: BaseException) -> None:
    """Warn once that the kernels cannot be used here, and why; stats mode then takes its other paths."""
    if not _unavailable:
        _unavailable.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}")
        warnings.warn(
            "fxdebug stats mode could not build its Triton statistics kernels for CUDA tensors "
            f"({_unavailable[0]}); it uses its other kernels instead: the same statistics, "
            "slower. Set FXDEBUG_STATS_KERNEL=0 to skip the attempt.",
            PerformanceWarning, stacklevel=3)
