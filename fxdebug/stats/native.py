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

__all__ = ["row_sums", "summary", "moments", "moments_many", "WIDE_MOMENTS_NUMEL", "fills_memory",
           "kernels_turned_off", "unavailable_reason", "openmp_runtimes", "shares_openmp_runtime"]

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define LANES 32

typedef struct { double sum, squares, shift, low, high, zeros, width; } row_t;

static inline float from_f32(float v) { return v; }
static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline float from_f16(uint16_t h) {
    uint32_t m = h & 0x3ffu, e = h & 0x7c00u;
    uint32_t normal = ((uint32_t)(h & 0x7fffu) << 13) + (112u << 23);
    uint32_t special = 0x7f800000u | (m << 13);
    float small = (float)m * 0x1p-24f;  /* a subnormal: a normal float32, exact */
    uint32_t u; memcpy(&u, &small, 4);
    u = e == 0 ? u : (e == 0x7c00u ? special : normal);
    u |= (uint32_t)(h & 0x8000u) << 16;
    float f; memcpy(&f, &u, 4); return f;
}

/* LANES values from x as float32: x itself, or widened into buf. */
static inline const float* block_f32(const float* x, float* buf) { (void)buf; return x; }
static inline const float* block_bf16(const uint16_t* x, float* buf) {
    for (int j = 0; j < LANES; j++) buf[j] = from_bf16(x[j]);
    return buf;
}
static inline const float* block_f16(const uint16_t* x, float* buf) {
#ifdef __F16C__  /* the CPU's own conversion: exact, subnormals too, whatever MXCSR says */
    for (int j = 0; j < LANES; j += 8)
        _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + j))));
#else
    for (int j = 0; j < LANES; j++) buf[j] = from_f16(x[j]);
#endif
    return buf;
}

#define STEP(j, v) do { float d_ = (v) - shift; s[j] += d_; q[j] += d_ * d_;          \
    lo[j] = (v) < lo[j] ? (v) : lo[j]; hi[j] = (v) > hi[j] ? (v) : hi[j];               \
    z[j] += (v) == 0.0f; } while (0)

#define ROW_FN(NAME, TYPE, LOAD, BLOCK)                                                \
static void NAME(const TYPE* x, int64_t width, row_t* out) {                           \
    float shift = LOAD(x[0]);                                                          \
    float s[LANES], q[LANES], lo[LANES], hi[LANES], buf[LANES]; int32_t z[LANES];      \
    for (int j = 0; j < LANES; j++) {                                                  \
        s[j] = 0.0f; q[j] = 0.0f; lo[j] = INFINITY; hi[j] = -INFINITY; z[j] = 0;       \
    }                                                                                  \
    int64_t i = 0;                                                                     \
    for (; i + LANES <= width; i += LANES) {                                           \
        const float* v = BLOCK(x + i, buf);                                            \
        for (int j = 0; j < LANES; j++) STEP(j, v[j]);                                 \
    }                                                                                  \
    for (int j = 0; i + j < width; j++) { float v = LOAD(x[i + j]); STEP(j, v); }     \
    for (int step = LANES / 2; step > 0; step /= 2)                                    \
        for (int j = 0; j < step; j++) {                                               \
            s[j] += s[j + step]; q[j] += q[j + step]; z[j] += z[j + step];             \
            lo[j] = lo[j + step] < lo[j] ? lo[j + step] : lo[j];                       \
            hi[j] = hi[j + step] > hi[j] ? hi[j + step] : hi[j];                       \
        }                                                                              \
    out->sum = s[0]; out->squares = q[0]; out->shift = shift; out->low = lo[0];        \
    out->high = hi[0]; out->zeros = z[0]; out->width = (double)width;                  \
}

ROW_FN(row_f32, float, from_f32, block_f32)
ROW_FN(row_bf16, uint16_t, from_bf16, block_bf16)
ROW_FN(row_f16, uint16_t, from_f16, block_f16)

/* out: count, mean, M2, min, max, zeros, bound. kind: 0 float32, 1 bfloat16, 2 float16. */
int fxdebug_row_sums(const void* data, int64_t numel, int64_t row, int kind, int threads,
                     int64_t parallel_rows, double* out) {
    int64_t rows = (numel + row - 1) / row;
    row_t* parts = (row_t*)malloc(sizeof(row_t) * (size_t)rows);
    if (parts == NULL) return 1;
    #pragma omp parallel for schedule(dynamic, 16) num_threads(threads) if(threads > 1 && rows >= parallel_rows)
    for (int64_t r = 0; r < rows; r++) {
        int64_t width = numel - r * row < row ? numel - r * row : row;
        if (kind == 0) row_f32((const float*)data + r * row, width, parts + r);
        else if (kind == 1) row_bf16((const uint16_t*)data + r * row, width, parts + r);
        else row_f16((const uint16_t*)data + r * row, width, parts + r);
    }
    double total = 0.0, low = INFINITY, high = -INFINITY, zeros = 0.0, bound = 0.0, m2 = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const row_t* p = parts + r;
        total += p->width * p->shift + p->sum;
        low = p->low < low ? p->low : low;
        high = p->high > high ? p->high : high;
        zeros += p->zeros;
        bound += p->squares;
        m2 += p->squares - p->sum * p->sum / p->width;
    }
    double mean = total / (double)numel;
    for (int64_t r = 0; r < rows; r++) {
        const row_t* p = parts + r;
        double deviation = p->shift + p->sum / p->width - mean;
        m2 += p->width * deviation * deviation;
    }
    free(parts);
    out[0] = (double)numel; out[1] = mean; out[2] = m2; out[3] = low; out[4] = high;
    out[5] = zeros; out[6] = bound;
    return 0;
}

/* out: the summary, count, mean, M2, min, max, zeros, non-finite (0), numel; returns 2 where
   the sums cannot give it (a NaN or Inf among the values, float32 overflow, or M2 imprecise:
   bound > bound_ratio * M2), as stats._from_sums decides from fxdebug_row_sums' part. */
int fxdebug_summary(const void* data, int64_t numel, int64_t row, int kind, int threads,
                    int64_t parallel_rows, double bound_ratio, double* out) {
    double part[7];
    int status = fxdebug_row_sums(data, numel, row, kind, threads, parallel_rows, part);
    if (status != 0) return status;
    if (!(isfinite(part[1]) && isfinite(part[2]) && isfinite(part[6]) && isfinite(part[3])
          && isfinite(part[4]) && part[6] <= bound_ratio * part[2])) return 2;
    for (int i = 0; i < 6; i++) out[i] = part[i];
    out[6] = 0.0; out[7] = (double)numel;
    return 0;
}

/* The moment summary (count, mean, M2, min, max, zeros, non-finite, numel, M3, M4), each row of
   `row` values read twice while it sits in the cache: the float32 sums of fxdebug_row_sums (its
   mean, min and max), then the sums of the powers of its deviations from that mean, scaled by
   the row's largest so that no power overflows, in float32 lanes (8 values each, then into
   float64 lanes) folded in a fixed order; the
   rows merged in float64, in order (Pebay's formulas). Returns 2 where a value is not finite
   or a float32 sum overflows (the caller takes the exact path). */
typedef struct { double count, mean, m2, m3, m4, low, high, zeros; int bad; } mrow_t;

#define MSTEP(j, v, ACC) do { ACC d_ = ((ACC)(v) - center) * inverse; ACC e_ = d_ * d_;      \
    s1[j] += d_; s2[j] += e_; s3[j] += e_ * d_; s4[j] += e_ * e_; } while (0)

#define MROW_FN(NAME, TYPE, LOAD, BLOCK, ROWFN, ACC)                                      \
static void NAME(const TYPE* x, int64_t width, mrow_t* out) {                           \
    row_t first; ROWFN(x, width, &first);                                              \
    float center = (float)(first.shift + first.sum / first.width);                    \
    float spread = fmaxf(first.high - center, center - first.low);                     \
    out->bad = !(isfinite(first.sum) && isfinite(first.squares) && isfinite(center)    \
                 && isfinite(spread));                                                 \
    if (out->bad) return;                                                              \
    ACC inverse = spread > 0.0f ? (ACC)1 / (ACC)spread : (ACC)1;                       \
    if (!isfinite(inverse)) { inverse = 1; spread = 1.0f; }                            \
    if (spread <= 0.0f) spread = 1.0f;                                                 \
    double w1[LANES], w2[LANES], w3[LANES], w4[LANES]; float buf[LANES];              \
    for (int j = 0; j < LANES; j++) { w1[j] = 0; w2[j] = 0; w3[j] = 0; w4[j] = 0; }     \
    int64_t i = 0;                                                                     \
    while (i < width) {  /* 8 values a lane in ACC, then into the lane's float64 sums */  \
        ACC s1[LANES], s2[LANES], s3[LANES], s4[LANES];                                \
        for (int j = 0; j < LANES; j++) { s1[j] = 0; s2[j] = 0; s3[j] = 0; s4[j] = 0; } \
        int64_t stop = i + 8 * LANES < width ? i + 8 * LANES : width;                  \
        for (; i + LANES <= stop; i += LANES) {                                        \
            const float* v = BLOCK(x + i, buf);                                        \
            for (int j = 0; j < LANES; j++) MSTEP(j, v[j], ACC);                       \
        }                                                                              \
        for (int j = 0; i + j < stop; j++) { float v = LOAD(x[i + j]); MSTEP(j, v, ACC); } \
        i = stop;                                                                      \
        for (int j = 0; j < LANES; j++) {                                              \
            w1[j] += s1[j]; w2[j] += s2[j]; w3[j] += s3[j]; w4[j] += s4[j];            \
        }                                                                              \
    }                                                                                  \
    for (int step = LANES / 2; step > 0; step /= 2)                                    \
        for (int j = 0; j < step; j++) {                                               \
            w1[j] += w1[j + step]; w2[j] += w2[j + step];                              \
            w3[j] += w3[j + step]; w4[j] += w4[j + step];                              \
        }                                                                              \
    double n = (double)width, h = (double)spread;                                      \
    double t2 = w2[0] * h * h, t3 = w3[0] * h * h * h;                                 \
    double t4 = w4[0] * h * h * h * h, e = w1[0] * h / n;                              \
    out->count = n; out->mean = (double)center + e; out->zeros = first.zeros;          \
    out->low = first.low; out->high = first.high;                                      \
    out->m2 = t2 - n * e * e;                                                          \
    out->m3 = t3 - 3.0 * e * t2 + 2.0 * n * e * e * e;                                 \
    out->m4 = t4 - 4.0 * e * t3 + 6.0 * e * e * t2 - 3.0 * n * e * e * e * e;         \
}

MROW_FN(mrow_f32, float, from_f32, block_f32, row_f32, float)
MROW_FN(mrow_bf16, uint16_t, from_bf16, block_bf16, row_bf16, float)
MROW_FN(mrow_f16, uint16_t, from_f16, block_f16, row_f16, float)
MROW_FN(wide_f32, float, from_f32, block_f32, row_f32, double)
MROW_FN(wide_bf16, uint16_t, from_bf16, block_bf16, row_bf16, double)
MROW_FN(wide_f16, uint16_t, from_f16, block_f16, row_f16, double)

/* wide: the deviations' powers summed in float64 (as exact as float64's own sums; some ten
   times the time: for small tensors, where the call costs more than the sums).
   minus (float32 only): the summary of data - minus, each row's differences taken in float32
   (torch.sub's bits) into a buffer in the cache: nothing written to memory.
   copy_to: each row's values copied there once summed (from the cache), unless it returns 1. */
#define MAX_MINUS_ROW 4096
int fxdebug_moments(const void* data, const void* minus, void* copy_to, int64_t numel,
                    int64_t row, int kind, int threads, int64_t parallel_rows, int wide,
                    double* out) {
    if (minus != NULL && (kind != 0 || row > MAX_MINUS_ROW)) return 1;
    int64_t rows = (numel + row - 1) / row;
    size_t size = kind == 0 ? 4 : 2;
    mrow_t* parts = (mrow_t*)malloc(sizeof(mrow_t) * (size_t)rows);
    if (parts == NULL) return 1;
    #pragma omp parallel for schedule(dynamic, 16) num_threads(threads) if(threads > 1 && rows >= parallel_rows)
    for (int64_t r = 0; r < rows; r++) {
        int64_t width = numel - r * row < row ? numel - r * row : row;
        if (minus != NULL) {
            float difference[MAX_MINUS_ROW];
            const float* a = (const float*)data + r * row;
            const float* b = (const float*)minus + r * row;
            for (int64_t i = 0; i < width; i++) difference[i] = a[i] - b[i];
            if (wide) wide_f32(difference, width, parts + r);
            else mrow_f32(difference, width, parts + r);
        } else if (wide) {
            if (kind == 0) wide_f32((const float*)data + r * row, width, parts + r);
            else if (kind == 1) wide_bf16((const uint16_t*)data + r * row, width, parts + r);
            else wide_f16((const uint16_t*)data + r * row, width, parts + r);
        } else if (kind == 0) mrow_f32((const float*)data + r * row, width, parts + r);
        else if (kind == 1) mrow_bf16((const uint16_t*)data + r * row, width, parts + r);
        else mrow_f16((const uint16_t*)data + r * row, width, parts + r);
        if (copy_to != NULL)
            memcpy((char*)copy_to + r * row * size, (const char*)data + r * row * size,
                   (size_t)width * size);
    }
    double n = 0, mean = 0, m2 = 0, m3 = 0, m4 = 0, low = INFINITY, high = -INFINITY, zeros = 0;
    for (int64_t r = 0; r < rows; r++) {
        const mrow_t* p = parts + r;
        if (p->bad) { free(parts); return 2; }
        zeros += p->zeros;
        low = p->low < low ? p->low : low;
        high = p->high > high ? p->high : high;
        double b = p->count;
        if (b == 0) continue;
        double a = n, total = a + b, d = p->mean - mean, d2 = d * d;
        m4 += p->m4 + d2 * d2 * a * b * (a * a - a * b + b * b) / (total * total * total)
              + 6.0 * d2 * (a * a * p->m2 + b * b * m2) / (total * total)
              + 4.0 * d * (a * p->m3 - b * m3) / total;
        m3 += p->m3 + d2 * d * a * b * (a - b) / (total * total)
              + 3.0 * d * (a * p->m2 - b * m2) / total;
        m2 += p->m2 + d2 * a * b / total;
        mean += d * b / total;
        n = total;
    }
    free(parts);
    if (!(isfinite(m2) && isfinite(m3) && isfinite(m4))) return 2;
    out[0] = n; out[1] = mean; out[2] = m2 > 0 ? m2 : 0.0; out[3] = low; out[4] = high;
    out[5] = zeros; out[6] = 0.0; out[7] = (double)numel; out[8] = m3;
    out[9] = m4 > 0 ? m4 : 0.0;
    return 0;
}

/* fxdebug_moments on `count` tensors (minus, copy_to: NULL or an entry each, NULL for none) */
int fxdebug_moments_many(const void** data, const void** minus, void** copy_to,
                         const int64_t* numel, const int* kind, int count, int64_t row,
                         int threads, int64_t parallel_rows, int64_t wide_numel, double* out,
                         int* status) {
    for (int i = 0; i < count; i++)
        status[i] = fxdebug_moments(data[i], minus ? minus[i] : NULL,
                                    copy_to ? copy_to[i] : NULL, numel[i], row, kind[i],
                                    threads, parallel_rows, numel[i] <= wide_numel,
                                    out + 10 * (int64_t)i);
    return 0;
}
"""

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
                 copy_to: list[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """:func:`moments` of each tensor, from one call for all of them (a call's Python costs
    more than the sums of a small tensor): None where the kernel does not apply to a tensor or
    declines it.

    ``minus``: the summaries are of ``tensors[i] - minus[i]`` (float32: the differences taken
    row by row in the cache, the bits of ``torch.sub``; nothing is written). ``copy_to``: on
    return ``copy_to[i]`` holds ``tensors[i]``'s values (copied from the cache as each row is
    summed, or by ``copy_`` where the kernel did not read the tensor).

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
            *[extra[i].data_ptr() for i in chosen]) for extra in (minus, copy_to)]
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
            if not done:
                copy_to[i].copy_(tensors[i])
    return found


def _same_memory(tensor: torch.Tensor, other: torch.Tensor, float32: bool = False) -> bool:
    """Whether ``other``'s memory is laid out as ``tensor``'s (minus= and copy_to=)."""
    return type(other) in _PLAIN and other.is_cpu and other.dtype == tensor.dtype \
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
