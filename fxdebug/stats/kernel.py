"""One pass over a tensor for every statistic stats mode keeps: a kernel built once.

torch has no single kernel that returns a tensor's mean, spread, minimum,
maximum and zero count together; its own reductions take four passes
(``aminmax``, ``sum``, ``vector_norm``, ``count_nonzero``, the last one slow on
tensors full of zeros, such as ReLU outputs). On the CPU, :func:`one_pass_sums`
takes a few lines of C built with the system's C compiler (:mod:`.native`:
the tensor's memory read once, at the speed of ``tensor.sum()``, a few
microseconds of Python a call). Elsewhere, and on a CPU where no C compiler
builds that, it compiles the same reduction with ``torch.compile`` (inductor
fuses it into one loop over the tensor) once per dtype and device type, with
dynamic sizes, so a whole model's activations share one compiled kernel. On the
CPU that one is compiled on an example of ``COMPILE_ROWS`` rows, so that its
C++ code splits the pass over the values among threads (by whole rows) and sums
the rows on one thread, in a fixed order: one fork of threads per call, and the
same bits whatever their number (the C kernel too)::

    one_pass_sums(tensor)                       tensor: float, at least MIN_NUMEL values
                                                (CPU: NATIVE_MIN_NUMEL, for the C kernel)
      ├─ its memory, as it lies                 (contiguous or channels-last: no copy)
      ├─ CPU: the C kernel, every value         -> a part: [count, mean, M2, min, max,
      │    (the last row shorter)                    zeros, bound]
      ├─ else compiled kernel, under no_grad
      │    rows of ROW values, each reduced
      │    around its first value, then the
      │    rows combined in float64
      └─ the last ``numel % ROW`` values, with torch's reductions in float64, merged

``M2`` is the sum of squared deviations from the mean. The spread is never
taken as ``sum(x**2) - n * mean**2``, which cancels when the mean is large
against the spread, by an amount that depends on the order of the sums (and
so on the CPU's vector width and thread count). The float32 kernels (CPU)
subtract from each row of ``ROW`` values its first value, sum the
deviations and their squares in float32, and combine the rows in float64
(Chan et al.'s formula). ``bound`` is the sum of the squared deviations: the
float32 rounding error of ``M2`` is at most a few ``ROW * 2**-24`` of it,
whatever the order of the sums, and the caller recomputes where ``bound`` is
large against ``M2`` (a row whose first value lies far from the others), or
where a NaN, an Inf or float32 overflow shows. The float64 kernel
(``wide=True``, for devices where nothing is read back during the run) takes
two passes over the finite values: the mean, then the deviations from it.
Where ``torch.compile`` cannot build the kernel (no C++
compiler, an unsupported platform), the first call warns once with the reason
and returns None from then on, and stats mode uses torch's reductions: same
statistics, slower. ``FXDEBUG_STATS_KERNEL=0`` turns both kernels off.

>>> part = one_pass_sums(torch.tensor([0.0, 2.0, float("inf")] * 20000), wide=True)
>>> part is None or [round(v) for v in part.tolist()] == [40000, 1, 40000, 0, 2, 20000, 40000]
True
"""

from __future__ import annotations

import contextlib
import threading
import types
import warnings
from typing import Callable

import torch

from ..errors import PerformanceWarning
from .native import fills_memory, kernels_turned_off, row_sums
from ..base.torch_compat import load_inductor

__all__ = ["one_pass_sums", "merge_parts", "dense_memory", "MIN_NUMEL", "NATIVE_MIN_NUMEL",
           "ROW", "BOUND_RATIO"]

MIN_NUMEL = 1 << 15
"""Smaller tensors use torch's reductions: the compiled call costs more than it saves."""

NATIVE_MIN_NUMEL = 1 << 10
"""On the CPU the C kernel (a call costs a few µs) takes tensors from this size on; below
``MIN_NUMEL`` the compiled kernel is not tried where the C kernel is missing."""

ROW = 2048
"""Values per row of the float32 kernel: each row is reduced in registers, then the rows."""

MIN_ROWS, MAX_ROWS = MIN_NUMEL // ROW, 1 << 12
"""Rows per call of the float32 kernel (at most 2**23 values a call)."""

COMPILE_ROWS = 64
"""Rows of the example the CPU kernel is compiled on (its sizes stay dynamic): few enough that
the reductions over the rows run on one thread, enough for the pass over the values to run on
every thread (inductor splits a loop where each thread gets 512 values or more)."""

BOUND_RATIO = 16.0
"""The float32 kernel's ``M2`` is used where ``bound <= BOUND_RATIO * M2``: its rounding error
is then a few ``BOUND_RATIO * ROW * 2**-24`` of it at worst, whatever the order of the sums,
and about 1e-6 in practice."""

_INF = float("inf")
_CHUNK = 1 << 24  # values per call of the float64 kernel
_kernels: dict[tuple[str, bool, torch.dtype], Callable[[torch.Tensor], torch.Tensor]] = {}
_lock = threading.Lock()
_unavailable: list[str] = []
_NO_CONTEXT = contextlib.nullcontext()


def _rows_part(values: torch.Tensor) -> torch.Tensor:
    """``[count, mean, M2, min, max, zeros, bound]`` of rows of ROW values (float64; see the module)."""
    values = values.float() if values.dtype in (torch.float16, torch.bfloat16) else values
    width = values.shape[1]
    shift = values[:, :1]  # each row's first value (a median of three: 20% slower on a CPU)
    deviation = values - shift  # a NaN or Inf, or float32 overflow, shows in the sums
    sums = deviation.sum(1).double()
    squares = (deviation * deviation).sum(1).double()
    zeros = (values == 0).to(values.dtype).sum(1)  # a float count vectorises; exact per row
    row_means = shift[:, 0].double() + sums / width
    mean = row_means.mean()
    m2 = (squares - sums * sums / width).sum() + width * (row_means - mean).square().sum()
    return torch.stack([torch.full_like(mean, values.numel()), mean, m2,
                        values.amin(1).amin().double(), values.amax(1).amax().double(),
                        zeros.double().sum(), squares.sum()])


def _finite_part(values: torch.Tensor) -> torch.Tensor:
    """``[count, mean, M2, min, max, zeros, bound]`` over the finite values, float64, two passes."""
    finite = torch.isfinite(values)
    count = finite.double().sum()
    safe = count.clamp(min=1)
    wide = values.double()
    mean = torch.where(finite, wide, 0.0).sum() / safe
    deviation = torch.where(finite, wide - mean, 0.0)
    sums = deviation.sum()
    squares = (deviation * deviation).sum()
    return torch.stack([
        count,
        mean + sums / safe,
        squares - sums * sums / safe,
        torch.where(finite, values, _INF).amin().double(),
        torch.where(finite, values, -_INF).amax().double(),
        (values == 0).double().sum(),
        squares,
    ])


def _tail_part(values: torch.Tensor) -> torch.Tensor:
    """What the float32 kernel returns, for a few values (a tail, a short last chunk): torch's ops, float64."""
    wide = values.double().reshape(-1)
    count = wide.numel()
    mean = wide.mean()
    deviation = wide - mean
    sums, squares = deviation.sum(), deviation.dot(deviation)
    low, high = torch.aminmax(wide)
    return torch.stack([torch.tensor(float(count), dtype=torch.float64), mean + sums / count,
                        squares - sums * sums / count, low, high,
                        (wide == 0).sum().double(), squares])


def merge_parts(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Two parts ``[count, mean, M2, min, max, zeros, bound]`` as one (Chan et al.'s formula).

    A part of count 0 has mean 0. Works on the parts' device; reads nothing back.

    >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0, 4.0])
    >>> merged = merge_parts(_tail_part(a), _tail_part(b))
    >>> [round(v, 4) for v in merged.tolist()[:6]]
    [5.0, 2.0, 10.0, 0.0, 4.0, 1.0]
    """
    n_a, n_b = first[0], second[0]
    count = n_a + n_b
    delta = second[1] - first[1]
    return torch.stack([
        count,
        first[1] + delta * n_b / count.clamp(min=1),
        first[2] + second[2] + delta * delta * n_a * n_b / count.clamp(min=1),
        torch.minimum(first[3], second[3]),
        torch.maximum(first[4], second[4]),
        first[5] + second[5],
        first[6] + second[6],
    ])


def _merge_on_host(parts: list[list[float]]) -> torch.Tensor:
    """:func:`merge_parts` of parts read back (the float32 kernel's, on the CPU): Python floats."""
    count, mean, m2, low, high, zeros, bound = parts[0]
    for n_b, mean_b, m2_b, low_b, high_b, zeros_b, bound_b in parts[1:]:
        total = count + n_b
        delta = mean_b - mean
        mean += delta * n_b / total
        m2 += m2_b + delta * delta * count * n_b / total
        count, low, high = total, min(low, low_b), max(high, high_b)
        zeros, bound = zeros + zeros_b, bound + bound_b
    return torch.tensor([count, mean, m2, low, high, zeros, bound], dtype=torch.float64)


def dense_memory(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if its values fill its memory in some order (contiguous, channels-last), else a copy."""
    return tensor if fills_memory(tensor) else tensor.contiguous()


def _block(dense: torch.Tensor, start: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Values ``start`` onwards of ``dense``'s memory as a contiguous tensor of ``shape``.

    The result is no view of another tensor (``set_`` on the storage), so the
    compiled kernel's guards see a plain tensor whatever the layout it came from.
    """
    strides = (shape[1], 1) if len(shape) == 2 else (1,)
    block = torch.empty(0, dtype=dense.dtype, device=dense.device)
    return block.set_(dense.untyped_storage(), dense.storage_offset() + start, shape, strides)


def _parts(kernel, dense: torch.Tensor, wide: bool) -> list[torch.Tensor]:
    """The kernel over chunks of ``dense``'s memory: one part ``[count, mean, M2, ...]`` each.

    The float32 kernel takes each chunk as rows of ``ROW`` values (16 to
    ``MAX_ROWS`` rows); values past the last whole row, or in a last chunk of
    fewer than 16 rows, take torch's reductions.
    """
    numel = dense.numel()
    if wide:
        if numel <= _CHUNK:
            return [kernel(_block(dense, 0, (numel,)))]
        return [kernel(_block(dense, start, (min(_CHUNK, numel - start),)))
                for start in range(0, numel, _CHUNK)]
    rows, parts = numel // ROW, []
    if rows * ROW == numel and MIN_ROWS <= rows <= MAX_ROWS:  # the common case: one call
        return [kernel(_block(dense, 0, (rows, ROW)))]
    for first in range(0, rows, MAX_ROWS):
        count = min(MAX_ROWS, rows - first)
        block = _block(dense, first * ROW, (count, ROW))
        parts.append(kernel(block) if count >= MIN_ROWS else _tail_part(block))
    if rows * ROW < numel:
        parts.append(_tail_part(_block(dense, rows * ROW, (numel - rows * ROW,))))
    return parts


def _kernel_template(values, _wide=False):
    return _finite_part(values) if _wide else _rows_part(values)


def _kernel(device_type: str, wide: bool, dtype: torch.dtype):
    """``torch.compile`` of the kernel for one device type, accumulation and dtype.

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
                load_inductor()  # without torch 2.11's warnings about its own code
                kernel = torch.compile(function, dynamic=True, fullgraph=True)
                if not wide and device_type == "cpu":
                    # Compiled first on a few rows: the C++ code forks threads for the pass
                    # over the values only. Sized from a large tensor, it would also fork them
                    # for each of the five small reductions over the rows' sums: six thread
                    # fork-joins a call, each a stall where other work holds the cores.
                    with torch.no_grad():
                        kernel(torch.zeros(COMPILE_ROWS, ROW, dtype=dtype))
                _kernels[key] = kernel
    return kernel


def one_pass_sums(tensor: torch.Tensor, wide: bool = False) -> torch.Tensor | None:
    """``[count, mean, M2, min, max, zeros, bound]`` of a float tensor, float64 on its device.

    By default (the float32 kernel) over every value: a NaN or Inf shows as a
    non-finite number, and the caller checks ``bound <= BOUND_RATIO * M2``
    before it trusts ``M2`` (see the module docstring). ``wide=True`` is over
    the finite values, in float64. Returns None where the compiled kernel is
    off or could not be built.

    >>> part = one_pass_sums(torch.ones(1 << 16))
    >>> part is None or part.tolist() == [65536.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    True
    """
    if _unavailable or kernels_turned_off():
        return None
    device_type = tensor.device.type
    dense = dense_memory(tensor.detach())  # (detached: a copy records no autograd)
    if not wide and device_type == "cpu":  # the C kernel: the same sums, at the speed of a read
        part = row_sums(dense, ROW)
        if part is not None:
            return part
    if tensor.numel() < MIN_NUMEL:  # a compiled call costs more than torch's reductions here
        return None
    try:
        kernel = _kernel(device_type, wide, tensor.dtype)
        with torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT:
            if torch.is_autocast_enabled(device_type):
                with torch.autocast(device_type, enabled=False):
                    parts = _parts(kernel, dense, wide)
            else:
                parts = _parts(kernel, dense, wide)
            if len(parts) == 1:
                return parts[0]
            if wide:  # nothing read back: merged on the device
                merged = parts[0]
                for part in parts[1:]:
                    merged = merge_parts(merged, part)
                return merged
            return _merge_on_host([part.tolist() for part in parts])
    except Exception as error:  # noqa: BLE001 - any compile failure: say it once, use torch's ops
        if not _unavailable:
            _unavailable.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            warnings.warn(
                "fxdebug stats mode could not compile its one-pass statistics kernel "
                f"({_unavailable[0]}); it uses torch's own reductions instead: the same "
                "statistics, about 1.3x slower. Set FXDEBUG_STATS_KERNEL=0 to skip the attempt.",
                PerformanceWarning, stacklevel=2)
        return None
