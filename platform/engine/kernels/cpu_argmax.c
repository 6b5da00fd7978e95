/* Greedy sampling's argmax (torch's runs ~45 us over a 32k vocabulary). */
#include "cpu_argmax.h"

/* argmax_row (cpu_argmax.h). */
PDSERVE_INTERNAL int64_t argmax_row(const float *v, int64_t n) {
    float best = v[0];
    int has_nan = v[0] != v[0];
    int64_t i = 1;
#ifdef HAVE_AVX2
    if (n >= 16) {
        __m256 mx = _mm256_loadu_ps(v), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 a = _mm256_loadu_ps(v + i);
            mx = _mm256_max_ps(mx, a);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int j = 0; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
        has_nan |= _mm256_movemask_ps(nan) != 0;
    }
#endif
    for (; i < n; ++i) {
        has_nan |= v[i] != v[i];
        best = v[i] > best ? v[i] : best;
    }
    i = 0;
#ifdef HAVE_AVX2
    const __m256 target = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(v + i);
        const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(a, a, _CMP_UNORD_Q)
                                                   : _mm256_cmp_ps(a, target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; ++i)
        if (has_nan ? v[i] != v[i] : v[i] == best) return i;
    return 0;
}


/* out[r] = argmax_row of x's row r (rows of n > 0 floats, dense). */
void pdserve_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= 8 * PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * n, n);
}
