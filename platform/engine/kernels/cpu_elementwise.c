/* The elementwise kernels' entry points, over rows (the row functions: cpu_elementwise.h). */
#include "cpu_elementwise.h"

/* rms_norm_row (cpu_elementwise.h). */
PDSERVE_INTERNAL __attribute__((noinline)) void rms_norm_row(float *x, const float *delta, const float *weight,
                                                             float *out, int64_t dim, float eps) {
    if (delta != NULL) {
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) x[i] += delta[i];
    }
    const float inv = 1.0f / sqrtf(sum_of_squares(x, dim) / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * weight[i];
}

void pdserve_rms_norm_f32(float *x, const float *delta, const float *weight, float *out, int64_t rows,
                          int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(x + r * dim, delta != NULL ? delta + r * dim : NULL, weight, out + r * dim, dim, eps);
}

void pdserve_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * dim, out + r * dim, dim);
}

/* x: [tokens, *, head_dim] with token stride `token_stride`; cos_sin: [tokens, 2, head_dim / 2]. */
void pdserve_rotary_f32(float *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
                        const float *cos_sin, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; ++t) rotary_token(x + t * token_stride, heads, head_dim, cos_sin + t * head_dim);
}
