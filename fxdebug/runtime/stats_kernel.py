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
import warnings

import torch

__all__ = ["one_pass_sums", "MIN_NUMEL"]

MIN_NUMEL = 1 << 15
"""Smaller tensors use torch's reductions: the compiled call costs more than it saves."""

_INF = float("inf")
_CHUNK = 1 << 24
_kernels: dict[tuple[str, bool], object] = {}
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
    """A 1-D tensor of ``tensor``'s values, a view where its memory is dense."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    for memory_format in (torch.channels_last, torch.channels_last_3d):
        if tensor.dim() == (4 if memory_format is torch.channels_last else 5) and \
                tensor.is_contiguous(memory_format=memory_format):
            return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())
    return tensor.reshape(-1)


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


def _kernel(device_type: str, wide: bool):
    key = (device_type, wide)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                def kernel(flat, _wide=wide):
                    return _sums(flat, _wide)
                kernel = torch.compile(kernel, dynamic=True, fullgraph=True)
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
    kernel = _kernel(tensor.device.type, wide)
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
