"""The C source of :mod:`fxdebug.stats.native`'s kernels (built there with the system's C compiler).

Row sums (``fxdebug_row_sums``, ``fxdebug_summary``: the 8-number summary) and moment
summaries (``fxdebug_moments``, ``fxdebug_moments_many``: the ten numbers of
:mod:`fxdebug.stats.moments`, with a difference taken or a copy made in the same read).

>>> "fxdebug_moments_many" in SOURCE
True
"""

__all__ = ["SOURCE"]

SOURCE = r"""
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

/* fxdebug_moments on `count` tensors (minus, copy_to: NULL or an entry each, NULL for none):
   the tensors of fewer than parallel_rows rows shared among the threads, one thread each, then
   the larger ones one by one, their rows shared (each tensor's bits as on one thread). */
int fxdebug_moments_many(const void** data, const void** minus, void** copy_to,
                         const int64_t* numel, const int* kind, int count, int64_t row,
                         int threads, int64_t parallel_rows, int64_t wide_numel, double* out,
                         int* status) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if(threads > 1 && count > 1)
    for (int i = 0; i < count; i++)
        if ((numel[i] + row - 1) / row < parallel_rows)
            status[i] = fxdebug_moments(data[i], minus ? minus[i] : NULL,
                                        copy_to ? copy_to[i] : NULL, numel[i], row, kind[i], 1,
                                        parallel_rows, numel[i] <= wide_numel,
                                        out + 10 * (int64_t)i);
    for (int i = 0; i < count; i++)
        if ((numel[i] + row - 1) / row >= parallel_rows)
            status[i] = fxdebug_moments(data[i], minus ? minus[i] : NULL,
                                        copy_to ? copy_to[i] : NULL, numel[i], row, kind[i],
                                        threads, parallel_rows, numel[i] <= wide_numel,
                                        out + 10 * (int64_t)i);
    return 0;
}
"""
