"""Fake low precision: a tensor rounded to bfloat16, float16 or float8 and back, as the
generated code of :class:`fxdebug.passes.FakePrecision` calls it.

Every value stays in its own dtype (float32): only the numbers it can hold change.

* ``bfloat16`` / ``float16``: ``x.to(dtype).to(x.dtype)``, torch's own rounding (float16
  overflows to ``inf`` as a real float16 tensor does).
* ``float8_e4m3fn`` / ``float8_e5m2``: scaled as torchao's float8 training recipes scale
  (``scale = max(dtype) / amax``, amax clamped below at 1e-12, computed in float64 and
  kept in float32), over the whole tensor (``axis=None``: tensor-wise) or along
  ``axis`` (row-wise: one scale per row of the dimensions not in ``axis``), then
  ``(x * scale).clamp(-max, max).to(float8).to(x.dtype) / scale``. The clamp is
  torchao's (``to_fp8_saturated``): torch's own ``.to(torch.float8_e5m2)`` does *not*
  saturate (a value past the largest one becomes ``inf``), nor does ``.to(float8_e4m3fn)``
  on every torch release and device (NaN there; recent releases saturate on the CPU), so
  the cast saturates, as torchao's, wherever it runs. Everything else, subnormals
  included, is torch's own rounding, bit for bit.

:func:`fake_cast` is the node function: forward the rounded value; backward the
gradient passed straight through, or rounded itself (``grad_dtype``, with its own
amax scale for float8), as a low-precision backward computes with it.

>>> import torch
>>> x = torch.tensor([1.0, 3.14159, 1e-8, 500.0])
>>> fake_cast(x, "bfloat16").tolist() == x.to(torch.bfloat16).float().tolist()
True
>>> cast_scaled(x, "float8_e4m3fn", torch.tensor(1.0)).tolist()   # saturates at 448
[1.0, 3.25, 0.0, 448.0]
"""

from __future__ import annotations

import math

import torch
from torch.fx.node import has_side_effect

from ..errors import FxdebugError
from .nodes import emit_if_tracing

__all__ = ["FLOAT8", "LOW_PRECISION", "check_dtype", "torch_dtype", "amax", "amax_to_scale",
           "float8_scale", "cast_scaled", "round_to", "fake_cast", "range_stats"]

FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
LOW_PRECISION = ("bfloat16", "float16") + FLOAT8
EPS = 1e-12  # torchao's floor under amax


def check_dtype(dtype: str, where: str = "fxdebug.fake_precision") -> str:
    """``dtype`` as a name of :data:`LOW_PRECISION` (``torch.bfloat16`` works too), or an error.

    >>> check_dtype(torch.float8_e4m3fn)
    'float8_e4m3fn'
    """
    name = str(dtype).removeprefix("torch.")
    if name not in LOW_PRECISION:
        raise FxdebugError(f"{where}: dtype {dtype!r} is not one fxdebug can fake; use one of "
                           f"{', '.join(LOW_PRECISION)}.")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float8_e4m3fn`` for ``"float8_e4m3fn"``.

    >>> torch_dtype("bfloat16")
    torch.bfloat16
    """
    return getattr(torch, check_dtype(name))


def amax(x: torch.Tensor, axis: tuple[int, ...] | None = None) -> torch.Tensor:
    """``max |x|`` over the tensor (``axis=None``) or over ``axis`` (kept as size-1 dims).

    >>> amax(torch.tensor([[1.0, -4.0], [2.0, 0.5]]), (-1,)).flatten().tolist()
    [4.0, 2.0]
    """
    magnitude = x.detach().abs()
    if axis is None:
        return magnitude.amax()
    return magnitude.amax(dim=axis, keepdim=True)


def amax_to_scale(value: torch.Tensor, dtype: str) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``max(dtype) / max(amax, 1e-12)`` in float64, as float32.

    >>> amax_to_scale(torch.tensor(448.0), "float8_e4m3fn").item()
    1.0
    """
    largest = torch.finfo(torch_dtype(dtype)).max
    return (largest / value.to(torch.float64).clamp(min=EPS)).to(torch.float32)


def float8_scale(x: torch.Tensor, dtype: str, axis: tuple[int, ...] | None = None) -> torch.Tensor:
    """The amax scale torchao's recipes give ``x`` (tensor-wise, or along ``axis``).

    >>> float8_scale(torch.tensor([2.0, -8.0]), "float8_e5m2").item()
    7168.0
    """
    return amax_to_scale(amax(x, axis), dtype)


def _work(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the scaled cast computes in: float32 or float64 as it is, else float32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def cast_scaled(x: torch.Tensor, dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """``(x * scale).clamp(-max, max).to(dtype).to(x.dtype) / scale``: a float8 round trip.

    >>> cast_scaled(torch.tensor([0.3]), "float8_e4m3fn", torch.tensor(1.0)).item()
    0.3125
    """
    target = torch_dtype(dtype)
    largest = torch.finfo(target).max
    work = _work(x)
    scaled = (work * scale).clamp(-largest, largest)
    return (scaled.to(target).to(work.dtype) / scale).to(x.dtype)


def round_to(x: torch.Tensor, dtype: str, axis: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back: amax-scaled for float8, a plain cast otherwise.

    >>> round_to(torch.tensor([1.0, 1.001]), "bfloat16").tolist()
    [1.0, 1.0]
    """
    if not x.is_floating_point():
        return x  # integers and booleans pass unchanged
    name = check_dtype(dtype)
    if name in FLOAT8:
        return cast_scaled(x, name, float8_scale(x, name, axis))
    return x.to(torch_dtype(name)).to(x.dtype)


class _FakeCast(torch.autograd.Function):
    """Forward: ``round_to(x, dtype, axis)``; backward: the gradient as it is, or rounded."""

    @staticmethod
    def forward(ctx, x, dtype, axis, grad_dtype, grad_axis):
        ctx.grad = (grad_dtype, grad_axis)
        return x if dtype is None else round_to(x, dtype, axis)

    @staticmethod
    def backward(ctx, grad):
        grad_dtype, grad_axis = ctx.grad
        if grad is not None and grad_dtype is not None:
            grad = round_to(grad, grad_dtype, grad_axis)
        return grad, None, None, None, None


_fake_cast_function = _FakeCast.apply


@has_side_effect
def fake_cast(x, dtype: str | None, axis: tuple[int, ...] | None = None,
              grad_dtype: str | None = None, grad_axis: tuple[int, ...] | None = None):
    """Node function: ``x`` rounded to ``dtype`` (None: unchanged) in the forward, and its
    gradient rounded to ``grad_dtype`` (None: unchanged) in the backward.

    >>> x = torch.tensor([1.001], requires_grad=True)
    >>> y = fake_cast(x, None, grad_dtype="bfloat16")
    >>> (y * 1.001).sum().backward(); x.grad.tolist()
    [1.0]
    """
    emitted = emit_if_tracing(fake_cast, (x, dtype, axis, grad_dtype, grad_axis), {})
    if emitted is not None:
        return emitted
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return x
    if not x.requires_grad or not torch.is_grad_enabled():
        return x if dtype is None else round_to(x, dtype, axis)
    # through autograd.Function: autograd through `.to(dtype)` would round the gradient too
    return _fake_cast_function(x, dtype, axis, grad_dtype, grad_axis)


_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float8_e4m3fn": 3, "float8_e5m2": 2}


def _rounds_past_max(name: str) -> float:
    """The magnitude from which a value rounds past the largest one (max + half its ulp):
    464 for e4m3fn, 61440 for e5m2, 65520 for float16.

    >>> _rounds_past_max("float8_e4m3fn"), _rounds_past_max("float16")
    (464.0, 65520.0)
    """
    largest = torch.finfo(torch_dtype(name)).max
    return largest + 2.0 ** (math.floor(math.log2(largest)) - _MANTISSA_BITS[name]) / 2


def range_stats(x: torch.Tensor, dtype: str, axis: tuple[int, ...] | None = None
                ) -> dict[str, float]:
    """How ``x`` fares in ``dtype``: the fractions of its elements that overflow (past the
    largest value by more than rounding: they saturate in float8, become ``inf`` in
    float16) and underflow (nonzero, rounded to zero), and its amax.

    >>> s = range_stats(torch.tensor([1e4, 1e-3, 2e-3, 1.0]), "float8_e4m3fn")
    >>> s["underflow"], s["overflow"], s["amax"]
    (0.5, 0.0, 10000.0)
    """
    name = check_dtype(dtype, "fxdebug.precision_sensitivity")
    value = _work(x.detach())
    if value.numel() == 0:
        return {"overflow": 0.0, "underflow": 0.0, "amax": 0.0}
    rounded = round_to(value, name, axis)
    scaled = value.abs() * float8_scale(value, name, axis) if name in FLOAT8 else value.abs()
    overflow = scaled >= _rounds_past_max(name)
    underflow = (rounded == 0) & (value != 0)
    numel = value.numel()
    return {"overflow": float(overflow.sum()) / numel, "underflow": float(underflow.sum()) / numel,
            "amax": float(value.abs().amax())}
