/* Elementwise kernels of the decoder layer: RMSNorm (with the residual add), silu * up, rotary.
 * Each replaces a handful of torch ops (and their temporaries) with one pass over the rows; a
 * decode step runs them 2-3 times per layer, so the per-op cost of torch adds up at small
 * batches. Rows of `dim` floats, dense. Parallel over rows only when there is enough work.
 *
 * This header holds the row functions, which the decode step (cpu_decoder.c) runs as its items
 * too; cpu_elementwise.c the entry points. */
#ifndef PDSERVE_CPU_ELEMENTWISE_H
#define PDSERVE_CPU_ELEMENTWISE_H

#include "cpu_runtime.h"

static inline float sum_of_squares(const float *x, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
    return acc;
}

/* One row: out = x / sqrt(mean(x^2) + eps) * weight; with `delta`, first x += delta (the residual add).
 * out may be x. One compiled copy (cpu_elementwise.c, never inlined) serves the entry point and the
 * decode step: inlined into each, the sum's vectorisation may differ by context, and the two paths
 * must agree bit for bit (they did not for Qwen3's per-head norms). */
PDSERVE_INTERNAL void rms_norm_row(float *x, const float *delta, const float *weight, float *out, int64_t dim,
                                   float eps);

/* One row: out[i] = silu(gate_up[i]) * gate_up[dim + i]  (gate and up side by side, as the merged
 * projection writes them). */
static inline void silu_mul_row(const float *g, float *o, int64_t dim) {
    const float *u = g + dim;
    int64_t i = 0;
#ifdef HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= dim; i += 8) {
        /* sigmoid from exp(-|x|) <= 1, so nothing overflows: 1/(1+e) for x >= 0, e/(1+e) below. */
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));
        __m256 num = _mm256_blendv_ps(one, e, x);  /* sign bit of x picks e */
        __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < dim; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Rotate heads [0, heads) of one token in place, neox style (halves): x1' = x1 cos - x2 sin,
 * x2' = x2 cos + x1 sin. c: the token's position's row of the table, cos then sin (head_dim / 2 each). */
static inline void rotary_token(float *x, int64_t heads, int64_t head_dim, const float *c) {
    const int64_t half = head_dim / 2;
    const float *s = c + half;
    for (int64_t h = 0; h < heads; ++h) {
        float *x1 = x + h * head_dim;
        float *x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

#endif
