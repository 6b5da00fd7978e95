/* What every CPU kernel file shares (engine/kernels/cpu_*.c, built by cpu_kernels.py into one
 * library): system headers, fp32/bf16 element helpers, the AVX2 helpers several kernels use,
 * per-thread scratch memory and 2 MiB pages. The kernels, one file per family:
 *   cpu_linear.h/.c            the linear layers' matmul over weights packed in column panels
 *   cpu_attention.h            paged attention's shared pieces (cache rows, `attend`)
 *   cpu_decode_attention.c     paged decode attention
 *   cpu_prefill_attention.c    a sequence's prefill chunk, causal, on the matmul's tiles
 *   cpu_elementwise.h/.c       RMSNorm with the residual add, silu * up, rotary
 *   cpu_argmax.h/.c            greedy sampling's argmax
 *   cpu_token_bitmask.c        a grammar's packed token mask applied to logits
 *   cpu_decoder.h/.c           a whole decode step in one call, token ids to logits
 *   cpu_decoder_threads.c      the decode step's own threads and how they share its work
 *
 * Activations and sums are fp32 throughout. The KV cache holds fp32, or bf16 (`kv_bf16`: the upper
 * half of an fp32, rounded to nearest even as torch rounds), which halves the bytes attention
 * reads; a packed weight's panels likewise hold fp32 or bf16 (`wbf16`, weight-only bf16).
 *
 * Built with the system C compiler (-O3 -march=native -fopenmp -pthread); loaded after torch, so
 * `libgomp.so.1` resolves to the OpenMP runtime torch already runs (one thread pool). Linux only:
 * the decode step's helpers sleep on a futex. AVX2/FMA code paths where the CPU has them, plain C
 * (vectorised by the compiler) elsewhere; AVX-512 for the matmul's tiles and decode attention's
 * usual head shapes where it has that.
 *
 * Every file includes this header first. A function one file defines for another is
 * PDSERVE_INTERNAL (hidden: the library exports only the `pdserve_*` entry points cpu_kernels.py
 * binds); the helpers a hot loop inlines are `static inline` in the headers, so each file
 * compiles them into its own loops. */
#ifndef PDSERVE_CPU_RUNTIME_H
#define PDSERVE_CPU_RUNTIME_H

#define _GNU_SOURCE /* madvise, syscall, pthread_setname_np */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PDSERVE_INTERNAL __attribute__((visibility("hidden")))

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

/* KV cache elements: 4-byte fp32, or 2-byte bf16. */
static inline float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* torch's rounding: to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float kv_at(const char *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float kv_dot(const float *restrict q, const char *k, int64_t n, int bf16) {
    if (!bf16) return dot(q, (const float *)k, n);
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) acc += q[i] * kv_at(k, i, 1);
    return acc;
}

static inline void kv_axpy(float *restrict y, float a, const char *v, int64_t n, int bf16) {
    if (!bf16) {
        axpy(y, a, (const float *)v, n);
        return;
    }
    for (int64_t i = 0; i < n; ++i) y[i] += a * kv_at(v, i, 1);
}

/* A cache row written from fp32. */
static inline void kv_store(char *dst, const float *src, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    for (int64_t i = 0; i < n; ++i) ((uint16_t *)dst)[i] = float_to_bf16(src[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* Eight cache elements from p as fp32. */
static inline __m256 kv_load8(const char *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* exp(x) for x <= 0 (a softmax's shifted scores): Cephes' expf polynomial, about 1 ulp. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* The row-wise kernels (elementwise, argmax) run their rows in parallel only from this many
 * elements on: below it, waking threads costs more than it saves. */
#define PARALLEL_MIN_ELEMS (1 << 15)

/* Per-thread scratch `which` (0-3) of at least `floats` floats, kept for the thread's next call;
 * NULL when it cannot grow. */
PDSERVE_INTERNAL float *scratch(int which, int64_t floats);

/* Ask for 2 MiB pages under [p, p + bytes) (cpu_runtime.c). */
void pdserve_want_huge_pages(void *p, int64_t bytes);

#endif
