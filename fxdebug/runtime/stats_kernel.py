"""One pass over a tensor for every statistic stats mode keeps: a kernel compiled once.

torch has no single kernel that returns a tensor's minimum, maximum, sum, sum of
squares, zero count and finite count together; its own reductions take four
passes (``aminmax``, ``sum``, ``vector_norm``, ``count_nonzero``, the last one
slow on tensors full of zeros, such as ReLU outputs). :func:`one_pass_sums`
compiles that reduction with ``torch.compile`` (inductor fuses the six into one
loop over the tensor) once per dtype and device type, with dynamic sizes, so a
whole model's activations share one compiled kernel::

    one_pass_sums(tensor)                       tensor: float, at least MIN_NUMEL values
      ├─ a 1-D view of its memory               (contiguous or channels-last: no copy)
      ├─ compiled kernel, under no_grad         -> [sum, sum of squares, min, max, zeros]
      │    rows of ROW values, each reduced       (float32, checked by the caller), or
      │    at once, then the rows combined        [finite count, sum, sum of squares,
      │                                            min, max, zeros] (float64, wide=True)
      └─ the last ``numel % ROW`` values, with torch's reductions, combined

Sums accumulate in float32 where the caller reads and checks them at once (per
row of ``ROW`` values, then across rows: a two-level sum, and several times
faster on the CPU than one long reduction, which inductor sums in a cascade;
the caller recomputes exactly where they could have cancelled or overflowed),
and in float64 over one long reduction where nothing is read back during the
run (``wide=True``, on GPUs). Where ``torch.compile`` cannot build the kernel (no C++ compiler, an
unsupported platform), the first call warns once with the reason and returns
None from then on, and stats mode uses torch's reductions: same statistics,
slower. ``FXDEBUG_STATS_KERNEL=0`` turns the kernel off.

>>> sums = one_pass_sums(torch.tensor([0.0, 2.0, float("inf")] * 20000), wide=True)
>>> sums is None or [round(v) for v in sums.tolist()] == [40000, 40000, 80000, 0, 2, 20000]
True
"""

from __future__ import annotations

import os
import threading
import types
import warnings

import torch

from ..errors import PerformanceWarning
from .direct_kernel import DirectKernel

__all__ = ["one_pass_sums", "MIN_NUMEL", "ROW"]

MIN_NUMEL = 1 << 15
"""Smaller tensors use torch's reductions: the compiled call costs more than it saves."""

ROW = 2048
"""Values per row of the float32 kernel: each row is reduced in registers, then the rows."""

MIN_ROWS, MAX_ROWS = MIN_NUMEL // ROW, 1 << 12
"""Rows per call of the float32 kernel (at most 2**23 values: float32 counts stay exact)."""

_INF = float("inf")
_CHUNK = 1 << 24  # values per call of the float64 kernel
_kernels: dict[tuple[str, bool, torch.dtype], DirectKernel] = {}
_lock = threading.Lock()
_unavailable: list[str] = []


def _sums(values: torch.Tensor, wide: bool) -> torch.Tensor:
    values = values.float() if values.dtype in (torch.float16, torch.bfloat16) else values
    if not wide:  # rows of ROW values; a NaN or Inf shows in the sums, and the caller rechecks
        zeros = (values == 0).to(values.dtype)  # a float count vectorises; exact below 2**24
        per_row = torch.stack([values.sum(1), (values * values).sum(1), values.amin(1),
                               values.amax(1), zeros.sum(1)])
        return torch.stack([per_row[0].sum(), per_row[1].sum(), per_row[2].amin(),
                            per_row[3].amax(), per_row[4].sum()])
    finite = torch.isfinite(values)
    kept = torch.where(finite, values, 0.0).double()
    return torch.stack([
        finite.double().sum(),
        kept.sum(),
        (kept * kept).sum(),
        torch.where(finite, values, _INF).amin().double(),
        torch.where(finite, values, -_INF).amax().double(),
        (values == 0).double().sum(),
    ])


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if its values fill its memory in some order (contiguous, channels-last), else a copy."""
    if tensor.is_contiguous() or any(
            tensor.dim() == dims and tensor.is_contiguous(memory_format=memory_format)
            for dims, memory_format in ((4, torch.channels_last), (5, torch.channels_last_3d))):
        return tensor
    return tensor.contiguous()


def _block(dense: torch.Tensor, start: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Values ``start`` onwards of ``dense``'s memory as a contiguous tensor of ``shape``.

    The result is no view of another tensor (``set_`` on the storage), so the
    compiled kernel's guards see a plain tensor whatever the layout it came from.
    """
    strides = (shape[1], 1) if len(shape) == 2 else (1,)
    block = torch.empty(0, dtype=dense.dtype, device=dense.device)
    return block.set_(dense.untyped_storage(), dense.storage_offset() + start, shape, strides)


def _tail_sums(values: torch.Tensor) -> torch.Tensor:
    """What the float32 kernel returns, for fewer than ROW values, with torch's reductions."""
    values = values.float().reshape(-1)
    low, high = torch.aminmax(values)
    return torch.stack([values.sum(), values.dot(values), low, high,
                        (values == 0).sum().to(values.dtype)])


def _chunked(kernel, dense: torch.Tensor, wide: bool) -> torch.Tensor:
    """The kernel over chunks of at most ``_CHUNK`` values (float32 counts stay exact), combined.

    The float32 kernel takes each chunk as rows of ``ROW`` values (16 to 4096
    rows); values past the last whole row, or in a last chunk of fewer than 16
    rows, take torch's reductions.
    """
    numel = dense.numel()
    if wide:
        if numel <= _CHUNK:
            return kernel(_block(dense, 0, (numel,)))
        parts = [kernel(_block(dense, start, (min(_CHUNK, numel - start),)))
                 for start in range(0, numel, _CHUNK)]
    else:
        rows = numel // ROW
        if rows * ROW == numel and rows <= MAX_ROWS:
            return kernel(_block(dense, 0, (rows, ROW)))
        parts = []
        for first in range(0, rows, MAX_ROWS):
            count = min(MAX_ROWS, rows - first)
            block = _block(dense, first * ROW, (count, ROW))
            parts.append(kernel(block) if count >= MIN_ROWS else _tail_sums(block))
        if rows * ROW < numel:
            parts.append(_tail_sums(_block(dense, rows * ROW, (numel - rows * ROW,))))
    summed = torch.stack(parts).double()
    low_col, high_col = (3, 4) if wide else (2, 3)
    out = summed.sum(0)
    out[low_col], out[high_col] = summed[:, low_col].amin(), summed[:, high_col].amax()
    return out


def _kernel_template(values, _wide=False):
    return _sums(values, _wide)


def _kernel(device_type: str, wide: bool, dtype: torch.dtype):
    """The compiled kernel for one device type, accumulation and dtype.

    Each gets a code object of its own: torch.compile keeps its compiled
    variants per code object, up to a limit, so kernels never crowd each other out.
    The float32 kernel on the CPU, which stats mode calls for every large
    tensor, is called without dynamo's guard check once that is verified safe
    (:class:`~fxdebug.runtime.direct_kernel.DirectKernel`).
    """
    key = (device_type, wide, dtype)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                name = f"fxdebug_stats_{device_type}_{'wide' if wide else 'narrow'}_{str(dtype)[6:]}"
                code = _kernel_template.__code__.replace(co_name=name, co_qualname=name)
                function = types.FunctionType(code, globals(), name, (wide,))
                direct = device_type == "cpu" and not wide  # the kernel that runs during a run
                kernel = DirectKernel(function, rows=(MIN_ROWS, MAX_ROWS) if direct else None)
                _kernels[key] = kernel
    return kernel


def one_pass_sums(tensor: torch.Tensor, wide: bool = False) -> torch.Tensor | None:
    """``[sum, sum of squares, min, max, zeros]`` of a float tensor in one pass.

    By default the sums are float32 over every value (a NaN or Inf shows in
    them); ``wide=True`` returns ``[finite count, sum, sum of squares, min, max,
    zeros]`` over the finite values, accumulated in float64. Returns None where
    the compiled kernel is off or could not be built (see the module docstring).

    >>> sums = one_pass_sums(torch.ones(1 << 16))
    >>> sums is None or sums.tolist() == [65536.0, 65536.0, 1.0, 1.0, 0.0]
    True
    """
    if _unavailable or os.environ.get("FXDEBUG_STATS_KERNEL", "1") == "0":
        return None
    kernel = _kernel(tensor.device.type, wide, tensor.dtype)
    try:
        with torch.no_grad():
            dense = _dense(tensor.detach())
            if torch.is_autocast_enabled(tensor.device.type):
                with torch.autocast(tensor.device.type, enabled=False):
                    return _chunked(kernel, dense, wide)
            return _chunked(kernel, dense, wide)
    except Exception as error:  # noqa: BLE001 - any compile failure: say it once, use torch's ops
        if not _unavailable:
            _unavailable.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            warnings.warn(
                "fxdebug stats mode could not compile its one-pass statistics kernel "
                f"({_unavailable[0]}); it uses torch's own reductions instead: the same "
                "statistics, about 1.3x slower. Set FXDEBUG_STATS_KERNEL=0 to skip the attempt.",
                PerformanceWarning, stacklevel=2)
        return None
