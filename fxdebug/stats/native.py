"""The CPU's one-pass statistics kernel, a few lines of C built with the system's C compiler.

:func:`row_sums` returns what the float32 kernel of :mod:`.kernel`
returns, ``[count, mean, M2, min, max, zeros, bound]``, with the same
arithmetic: rows of ``ROW`` values, each reduced around its first value in
float32, the rows combined in float64 (Chan et al.), the last, shorter row
like the others. It reads the tensor's memory once, at the speed of
``tensor.sum()``, and a call costs a few microseconds of Python (a
``torch.compile`` call costs about 40: its guards and wrapper)::

    row_sums(tensor)                   float32, bfloat16 or float16, dense memory, on the CPU
      ├─ rows split among torch.get_num_threads() threads (OpenMP), by whole rows
      │    each row: float32 sums in 32 lanes, folded in a fixed order
      └─ rows combined on one thread, in order: the same bits on any number of threads

Minimum and maximum take the first operand where one is NaN (the CPU's own
``min``): a NaN or Inf shows in the sums instead, and the caller recomputes
there. float16 and bfloat16 values widen to float32 exactly (float16's
subnormals too, whatever the CPU's denormal flags). The C source is compiled
once per process, in a temporary directory removed at once (``-march=native``:
the library never outlives the machine it was built for); without a C
compiler, or where the build fails, :func:`row_sums` returns None and the
caller takes the ``torch.compile`` kernel.

Its threads are torch's own: it is built with OpenMP only where the one
OpenMP runtime in the process is a ``libgomp.so.1`` (torch's, which the
library then shares: its parallel region runs on torch's thread pool). Any
other runtime (LLVM's ``libomp``, Intel's ``libiomp5``, a renamed
``libgomp-<hash>.so.1``, two of them, or none) would mean a second runtime
and a thread pool of its own in the user's process: there the rows take the
calling thread, with the same bits. Should a new runtime show up anyway
once the library is loaded, it is never asked for a thread.

>>> part = row_sums(torch.tensor([0.0, 2.0] * 20000))
>>> part is None or part.tolist() == [40000.0, 1.0, 40000.0, 0.0, 2.0, 20000.0, 80000.0]
True
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading

import torch

from .native_source import SOURCE as _SOURCE

__all__ = ["row_sums", "summary", "moments", "moments_many", "WIDE_MOMENTS_NUMEL", "fills_memory",
           "kernels_turned_off", "unavailable_reason", "openmp_runtimes", "shares_openmp_runtime"]


_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PARALLEL_ROWS = 64
"""Rows (of 2048 values) from which a call splits its rows among threads: below, a fork of
threads costs more than it saves."""

_FLAGS = (["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
          ["-O3", "-ffp-contract=fast", "-fopenmp"], ["-O3", "-march=native", "-ffp-contract=fast"],
          ["-O3"])
"""Tried in order (those with ``-fopenmp`` only where :func:`shares_openmp_runtime`): without
OpenMP the rows take one thread (the same bits)."""

_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []
unavailable_reason: list[str] = []
"""Why the C kernel could not be built (empty while it can, or before the first call)."""

_OPENMP_RUNTIME = re.compile(r"^lib(gomp|iomp5|omp)(-[0-9a-f]+)?\.so(\.[0-9.]+)?$")


def openmp_runtimes() -> list[str] | None:
    """The OpenMP runtimes mapped into this process (their paths, sorted), or None where that
    cannot be read (no ``/proc/self/maps``: not Linux).

    >>> found = openmp_runtimes()
    >>> found is None or all("omp" in os.path.basename(path) for path in found)
    True
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {fields[5].strip() for line in maps if len(fields := line.split(None, 5)) == 6}
    except OSError:
        return None
    return sorted(path for path in paths if _OPENMP_RUNTIME.match(os.path.basename(path)))


def shares_openmp_runtime(runtimes: list[str] | None) -> bool:
    """Whether a library built with ``-fopenmp`` (which asks for ``libgomp.so.1``) would run on
    the process's one OpenMP runtime rather than load a second: ``runtimes`` as
    :func:`openmp_runtimes` gives them.

    >>> shares_openmp_runtime(["/site-packages/torch/lib/libgomp.so.1"])
    True
    >>> shares_openmp_runtime(["/site-packages/torch/lib/libgomp-a34b3233.so.1"]), shares_openmp_runtime(None)
    (False, False)
    """
    return runtimes is not None and len(runtimes) == 1 \
        and os.path.basename(runtimes[0]) == "libgomp.so.1"


def _compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` (e.g. ``ccache gcc``), else cc, gcc or clang."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    path = next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)
    return None if path is None else [path]


def _build() -> ctypes.CDLL | None:
    """The compiled library, or None (the reason in ``unavailable_reason``)."""
    compiler = _compiler()
    if compiler is None:
        unavailable_reason.append("no C compiler (cc, gcc, clang or $CC) on the PATH")
        return None
    errors = []
    with tempfile.TemporaryDirectory(prefix="fxdebug_stats_", ignore_cleanup_errors=True) as folder:
        source = os.path.join(folder, "stats.c")
        with open(source, "w", encoding="utf-8") as file:
            file.write(_SOURCE)
        runtimes = openmp_runtimes()
        threaded = shares_openmp_runtime(runtimes)
        for number, flags in enumerate(_FLAGS):
            if "-fopenmp" in flags and not threaded:
                continue
            target = os.path.join(folder, f"stats{number}.so")
            command = [*compiler, *flags, "-std=c11", "-shared", "-fPIC", source, "-o", target]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as error:
                errors.append(f"{type(error).__name__}: {error}")
                continue
            if done.returncode != 0:
                errors.append((done.stderr.strip().splitlines() or ["failed"])[-1][:200])
                continue
            try:
                library = ctypes.CDLL(target)  # mapped: the file may go with its folder
            except OSError as error:
                errors.append(f"OSError: {error}")
                continue
            function = library.fxdebug_row_sums
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
            function.restype = ctypes.c_int
            function = library.fxdebug_summary
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p]
            function.restype = ctypes.c_int
            function = library.fxdebug_moments_many
            function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                 ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p]
            function.restype = ctypes.c_int
            # a runtime loaded with the library would start a thread pool of its own: never ask it
            library.fxdebug_threaded = ("-fopenmp" in flags  # type: ignore[attr-defined]
                                        and openmp_runtimes() == runtimes)
            return library
    unavailable_reason.append(f"{shlex.join(compiler)} could not build it: "
                              f"{errors[0] if errors else '?'}")
    return None


def _library_loaded() -> ctypes.CDLL | None:
    if not _library:
        with _lock:
            if not _library:
                _library.append(_build())
    return _library[0]


def row_sums(tensor: torch.Tensor, row: int = 2048) -> torch.Tensor | None:
    """``[count, mean, M2, min, max, zeros, bound]`` (float64) of a dense CPU float tensor's values.

    ``tensor`` must fill its memory (contiguous, channels-last: any order) and
    hold at least one value. None where the C kernel does not apply (another
    dtype or device, a tensor subclass) or could not be built.

    >>> part = row_sums(torch.ones(5000, dtype=torch.bfloat16))
    >>> part is None or part.tolist() == [5000.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    True
    """
    out, status = _call("fxdebug_row_sums", tensor, row, 7)
    return out if status == 0 else None  # 1: out of memory for the rows' sums


def summary(tensor: torch.Tensor, bound_ratio: float, row: int = 2048
            ) -> tuple[torch.Tensor | None, bool]:
    """``(the summary, declined)`` of a dense CPU float tensor (see :mod:`.summary`), float64, from
    one call: what :func:`row_sums` and the checks of ``stats._from_sums`` give, without their
    Python.

    The summary is None where the C kernel does not apply (as :func:`row_sums`) or its sums
    cannot give it; ``declined`` says it was the latter (a NaN or an Inf among the values,
    float32 overflow, or ``bound > bound_ratio * M2``): any kernel with these sums declines
    too, and the caller takes the slower, exact path.

    >>> s, declined = summary(torch.tensor([0.0, 2.0] * 20000), 16.0)
    >>> declined, s is None or s.tolist() == [40000.0, 1.0, 40000.0, 0.0, 2.0, 20000.0, 0.0, 40000.0]
    (False, True)
    """
    out, status = _call("fxdebug_summary", tensor, row, 8, ctypes.c_double(bound_ratio))
    return (out if status == 0 else None), status == 2


WIDE_MOMENTS_NUMEL = 1 << 16
"""Up to this many values the deviations' powers are summed in float64 (as exact as float64's
own sums); larger tensors sum them in float32 within each row (M3 and M4 within 1e-7 of float64:
reading the memory then costs more than the arithmetic, where float64's takes ten times it)."""


def moments(tensor: torch.Tensor, row: int = 2048) -> torch.Tensor | None:
    """The moment summary (:mod:`.moments`) of a dense CPU float32, bfloat16 or float16 tensor
    from one read of its memory: per row, the float32 sums of :func:`row_sums`, then the powers
    of the deviations from the row's mean (float64 up to ``WIDE_MOMENTS_NUMEL`` values), the
    rows merged in float64 in order (the same bits on any number of threads). None where the
    kernel does not apply, or declines (a value not finite, a float32 sum overflows).

    >>> s = moments(torch.tensor([1.0, 2.0, 3.0, 10.0]))
    >>> s is None or [round(v, 4) for v in s.tolist()] == [4.0, 4.0, 50.0, 1.0, 10.0, 0.0, 0.0, 4.0, 180.0, 1394.0]
    True
    >>> moments(torch.tensor([1.0, float("nan")])) is None
    True
    """
    return moments_many([tensor], row)[0]


def moments_many(tensors: list[torch.Tensor], row: int = 2048, *,
                 minus: list[torch.Tensor] | None = None,
                 copy_to: list[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
    """:func:`moments` of each tensor, from one call for all of them (a call's Python costs
    more than the sums of a small tensor): None where the kernel does not apply to a tensor or
    declines it.

    ``minus``: the summaries are of ``tensors[i] - minus[i]`` (float32: the differences taken
    row by row in the cache, the bits of ``torch.sub``; nothing is written). ``copy_to``: on
    return ``copy_to[i]`` holds ``tensors[i]``'s values (copied from the cache as each row is
    summed, or by ``copy_`` where the kernel did not read the tensor; None: no copy).

    >>> found = moments_many([torch.tensor([1.0, 3.0]), torch.arange(3), torch.ones(4)])
    >>> found[1] is None and all(s is None or s[1] in (2.0, 1.0) for s in found)
    True
    >>> a, b, kept = torch.tensor([5.0, 7.0]), torch.tensor([1.0, 2.0]), torch.empty(2)
    >>> d = moments_many([a], minus=[b], copy_to=[kept])[0]
    >>> kept.tolist(), d is None or d[1].item() == 4.5
    ([5.0, 7.0], True)
    """
    found: list[torch.Tensor | None] = [None] * len(tensors)
    copied = [False] * len(tensors)
    library = None if kernels_turned_off() else _library_loaded()
    chosen = [] if library is None else [
        i for i, tensor in enumerate(tensors) if _applies(tensor)
        and (minus is None or _same_memory(tensor, minus[i], float32=True))
        and (copy_to is None or _same_memory(tensor, copy_to[i]))]
    if chosen:
        count = len(chosen)
        pointers = (ctypes.c_void_p * count)(*[tensors[i].data_ptr() for i in chosen])
        others = [None if extra is None else (ctypes.c_void_p * count)(
            *[_pointer(extra[i]) for i in chosen]) for extra in (minus, copy_to)]
        sizes = (ctypes.c_int64 * count)(*[tensors[i].numel() for i in chosen])
        kinds = (ctypes.c_int * count)(*[_KINDS[tensors[i].dtype] for i in chosen])
        status = (ctypes.c_int * count)()
        out = torch.empty(count, 10, dtype=torch.float64)
        threads = torch.get_num_threads() if getattr(library, "fxdebug_threaded", False) else 1
        library.fxdebug_moments_many(pointers, *others, sizes, kinds, count, row,  # type: ignore[union-attr]
                                     threads, _PARALLEL_ROWS, WIDE_MOMENTS_NUMEL,
                                     out.data_ptr(), status)
        for j, i in enumerate(chosen):
            found[i] = out[j] if status[j] == 0 else None
            copied[i] = status[j] != 1  # 1: nothing done (no memory for the rows' sums)
    if copy_to is not None:
        for i, done in enumerate(copied):
            if not done and (target := copy_to[i]) is not None:
                target.copy_(tensors[i])
    return found


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _same_memory(tensor: torch.Tensor, other: torch.Tensor | None, float32: bool = False) -> bool:
    """Whether ``other``'s memory is laid out as ``tensor``'s (minus= and copy_to=; None: no
    tensor, nothing to check)."""
    return other is None or type(other) in _PLAIN and other.is_cpu and other.dtype == tensor.dtype \
        and other.shape == tensor.shape and other.stride() == tensor.stride() \
        and not other.is_neg() and (not float32 or tensor.dtype == torch.float32)


def _applies(tensor: torch.Tensor) -> bool:
    """Whether the C kernel reads ``tensor``'s memory: a dense CPU float32, bfloat16 or
    float16 tensor (not a subclass, not a lazy negation) with a value."""
    return tensor.dtype in _KINDS and tensor.is_cpu and type(tensor) in _PLAIN \
        and tensor.layout == torch.strided and not tensor.is_neg() and tensor.numel() > 0 \
        and fills_memory(tensor)


def _call(name: str, tensor: torch.Tensor, row: int, size: int, *extra) -> tuple[
        torch.Tensor | None, int]:
    """The C function ``name`` on ``tensor``'s memory, into a new float64 tensor of ``size``:
    ``(out, its status)``; ``(None, -1)`` where the kernel does not apply, is turned off or
    was not built."""
    if kernels_turned_off() or not _applies(tensor):
        return None, -1
    kind = _KINDS[tensor.dtype]
    library = _library_loaded()
    if library is None:
        return None, -1
    out = torch.empty(size, dtype=torch.float64)
    threads = torch.get_num_threads() if getattr(library, "fxdebug_threaded", False) else 1
    status = getattr(library, name)(tensor.data_ptr(), tensor.numel(), row, kind, threads,
                                    _PARALLEL_ROWS, *extra, out.data_ptr())
    return out, status


def kernels_turned_off() -> bool:
    """Whether ``FXDEBUG_STATS_KERNEL=0`` turns the statistics kernels off (this C kernel, the
    compiled and the Triton ones): torch's own reductions then, the same values, slower.

    >>> kernels_turned_off() == (os.environ.get("FXDEBUG_STATS_KERNEL") == "0")
    True
    """
    return os.environ.get("FXDEBUG_STATS_KERNEL", "1") == "0"


def fills_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values fill ``numel`` consecutive elements from its data pointer
    (contiguous or channels-last: in some order).

    >>> x = torch.ones(2, 3, 4, 5)
    >>> fills_memory(x), fills_memory(x.to(memory_format=torch.channels_last)), fills_memory(x[..., :2])
    (True, True, False)
    """
    return tensor.is_contiguous() or any(
        tensor.dim() == dims and tensor.is_contiguous(memory_format=memory_format)
        for dims, memory_format in ((4, torch.channels_last), (5, torch.channels_last_3d)))


_PLAIN = (torch.Tensor, torch.nn.Parameter)
