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
      └─ compiled kernel, under no_grad         -> [finite count, sum, sum of squares,
                                                    min, max, zeros]  (over finite values)

Sums accumulate in float32 where the caller reads and checks them at once
(inductor's cascade summation; the caller recomputes exactly where they could
have cancelled or overflowed), and in float64 where nothing is read back during
the run (``wide=True``, on GPUs). Where ``torch.compile`` cannot build the kernel (no C++ compiler, an
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

__all__ = ["one_pass_sums", "MIN_NUMEL"]

MIN_NUMEL = 1 << 15
"""Smaller tensors use torch's reductions: the compiled call costs more than it saves."""

_INF = float("inf")
_CHUNK = 1 << 24
_kernels: dict[tuple[str, bool, torch.dtype], object] = {}
_lock = threading.Lock()
_unavailable: list[str] = []


def _sums(flat: torch.Tensor, wide: bool) -> torch.Tensor:
    values = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
    if not wide:  # non-finite values show in the sums and the caller takes the masked path
        zeros = (values == 0).to(values.dtype)  # a float count vectorises; exact below 2**24
        return torch.stack([values.sum(), (values * values).sum(), values.amin(), values.amax(),
                            zeros.sum()])
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


def _flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of ``tensor``'s values: its own memory where it is dense, else a copy.

    The result is no view of another tensor (``set_`` on the storage), so the
    compiled kernel's guards see a plain 1-D tensor whatever the layout it came from.
    """
    dense = tensor.is_contiguous() or any(
        tensor.dim() == dims and tensor.is_contiguous(memory_format=memory_format)
        for dims, memory_format in ((4, torch.channels_last), (5, torch.channels_last_3d)))
    if not dense:
        tensor = tensor.contiguous()
    flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return flat.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))


def _chunked(kernel, flat: torch.Tensor, wide: bool) -> torch.Tensor:
    """The kernel over chunks of ``_CHUNK`` values (float32 counts stay exact), combined."""
    if flat.numel() <= _CHUNK:
        return kernel(flat)
    parts = [kernel(chunk) for chunk in flat.split(_CHUNK)]
    summed = torch.stack(parts).double()
    low_col, high_col = (3, 4) if wide else (2, 3)
    out = summed.sum(0)
    out[low_col], out[high_col] = summed[:, low_col].amin(), summed[:, high_col].amax()
    return out


def _kernel_template(flat, _wide=False):
    return _sums(flat, _wide)


def _kernel(device_type: str, wide: bool, dtype: torch.dtype):
    """The compiled kernel for one device type, accumulation and dtype.

    Each gets a code object of its own: torch.compile keeps its compiled
    variants per code object, up to a limit, so kernels never crowd each other out.
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
                kernel = torch.compile(function, dynamic=True, fullgraph=True)
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
            flat = _flat_view(tensor.detach())
            if torch.is_autocast_enabled(tensor.device.type):
                with torch.autocast(tensor.device.type, enabled=False):
                    return _chunked(kernel, flat, wide)
            return _chunked(kernel, flat, wide)
    except Exception as error:  # noqa: BLE001 - any compile failure: say it once, use torch's ops
        if not _unavailable:
            _unavailable.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            warnings.warn(
                "fxdebug stats mode could not compile its one-pass statistics kernel "
                f"({_unavailable[0]}); it uses torch's own reductions instead: the same "
                "statistics, about 1.3x slower. Set FXDEBUG_STATS_KERNEL=0 to skip the attempt.",
                RuntimeWarning, stacklevel=2)
        return None
