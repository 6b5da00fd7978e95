/* pdserve's fp32 CPU kernels, in this order: paged decode attention; the decoder layer's elementwise
 * work (RMSNorm with the residual add, silu * up, rotary); the linear layers' matmul over weights
 * packed in column panels; a whole decode step in one call, token ids to logits, on the decoder's
 * own threads (which share work without waiting for one another); greedy argmax.
 *
 * Paged decode attention: the torch path gathers a batch's blocks into one padded buffer and runs
 * SDPA over it, so the KV bytes cross memory three times and every sequence pays for the longest
 * one. Here each sequence (or, at small batches, each of its KV heads) reads its own blocks
 * straight from the cache, once: scores for the query heads that share a KV head (GQA), a
 * softmax, then the weighted sum of V.
 *
 * Layouts (row-major; strides in elements):
 *   q            [batch, num_heads, head_dim]       q_batch_stride, q_head_stride; last dim dense
 *   k_cache      [num_blocks, block_size, num_kv_heads, head_dim]   dense (one layer's K half)
 *   v_cache      same as k_cache
 * The caches hold fp32, or bf16 (`kv_bf16`: the upper half of an fp32, rounded to nearest even as
 * torch rounds), which halves the bytes attention reads. A packed weight's panels likewise hold
 * fp32 or bf16 (`wbf16`, weight-only bf16); activations and sums are fp32 throughout.
 *   block_tables [batch, table_width] int64, dense
 *   seq_lens     [batch] int64
 *   out          [batch, num_heads, head_dim]       dense
 *
 * Built by cpu_kernels.py with the system C compiler (-O3 -march=native -fopenmp -pthread); loaded
 * after torch, so `libgomp.so.1` resolves to the OpenMP runtime torch already runs (one thread
 * pool). Linux only: the decode step's helpers sleep on a futex.
 * AVX2/FMA code paths where the CPU has them, plain C (vectorised by the compiler) elsewhere; AVX-512
 * for the matmul's tiles and decode attention's usual head shapes where it has that.
 */

#define _GNU_SOURCE /* madvise, syscall, pthread_setname_np */
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

/* [sum(a0), ..., sum(a7)] */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                           __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
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

/* Token t's row of a sequence's cache (strides in bytes). */
static inline const char *row(const char *cache, const int64_t *table, int64_t t, int64_t block_size,
                              int64_t block_stride, int64_t token_stride) {
    return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
}

/* The cache lines one attend() reads, K's tokens then V's, asked for a few at a time ahead of
 * use. A sequence's blocks lie anywhere in the cache, so the hardware prefetcher loses the
 * stream at every block boundary: read cold, 16 KiB blocks came at ~11 GB/s on one core against
 * ~40 for one long run. Asked for ATTN_AHEAD tokens ahead in small steady portions between the
 * arithmetic (not in bursts, which fill the core's miss buffers and stall it), they came at ~15
 * GB/s, ~24 on 2 MiB pages (benchmarks/RESULTS.md). */
#define ATTN_AHEAD 32
typedef struct {
    const char *k, *v;
    const int64_t *table;
    int64_t len, block_size, block_stride, token_stride, lo, hi;  /* strides in bytes; [lo, hi): bytes of a row read */
    int64_t t, off;                                                /* next line: token t (V's from len on) */
    const char *base;                                              /* token t's row */
} kv_lines;

static inline void kv_lines_seek(kv_lines *s) {
    if (s->t < 2 * s->len) {
        const int v = s->t >= s->len;
        s->base = row(v ? s->v : s->k, s->table, s->t - v * s->len, s->block_size, s->block_stride, s->token_stride);
    }
}

static inline void kv_lines_fetch(kv_lines *s, int64_t lines) {
    for (; lines > 0 && s->t < 2 * s->len; --lines) {
        __builtin_prefetch(s->base + s->off, 0, 3);
        if ((s->off += 64) >= s->hi) {
            s->off = s->lo;
            ++s->t;
            kv_lines_seek(s);
        }
    }
}

#ifdef __AVX512F__
/* Sixteen cache elements from p as fp32. */
static inline __m512 kv_load16(const char *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Lane i: the sum of a[i]'s lanes (a transpose by halves: 15 adds for 16 sums). */
static inline __m512 hsum16(const __m512 *a) {
    __m512 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; ++i)
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
        s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* attend()'s pass 1 in 512-bit registers for G query heads per KV head (a constant: each G
 * compiles to its own loop), 16 / G tokens at a time: each K row is loaded and widened once for
 * all G heads (the 256-bit loop widens it once per head), 16 independent FMA chains summed
 * together. Returns how many tokens it scored. */
static inline __attribute__((always_inline)) int64_t scores_z(
    const float *q, int64_t q_head_stride, const void *k_cache, int kv_bf16, const int64_t *table, int64_t len,
    int64_t h0, int64_t h1, const int G, int64_t head_dim, int64_t block_size, int64_t block_stride,
    int64_t token_bytes, float scale, float *scores, kv_lines *ahead, int64_t row_lines) {
    const int T = 16 / G;
    const int64_t es = kv_bf16 ? 2 : 4, per_head = (T * row_lines + (h1 - h0) - 1) / (h1 - h0);
    int64_t t = 0;
    for (; t + T <= len; t += T) {
        const char *k[16];
        for (int j = 0; j < T; ++j) k[j] = row(k_cache, table, t + j, block_size, block_stride, token_bytes);
        for (int64_t h = h0; h < h1; ++h) {
            kv_lines_fetch(ahead, per_head);
            const float *qh = q + h * G * q_head_stride;
            __m512 acc[16];
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16) {
                __m512 qv[4];
                _Pragma("GCC unroll 4") for (int g = 0; g < G; ++g) qv[g] = _mm512_loadu_ps(qh + g * q_head_stride + d);
                _Pragma("GCC unroll 16") for (int j = 0; j < T; ++j) {
                    const __m512 kv = kv_load16(k[j] + (h * head_dim + d) * es, kv_bf16);
                    _Pragma("GCC unroll 4") for (int g = 0; g < G; ++g)
                        acc[g * T + j] = _mm512_fmadd_ps(qv[g], kv, acc[g * T + j]);
                }
            }
            float sums[16];  /* [g * T + j]: query head g, token t + j */
            _mm512_storeu_ps(sums, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
            for (int g = 0; g < G; ++g)
                memcpy(scores + ((h - h0) * G + g) * len + t, sums + g * T, sizeof(float) * T);
        }
    }
    return t;
}

/* attend()'s pass 2 for one KV head's G query rows over one block's n tokens, on C * 16 of its
 * dims from d0 (G and C constants): each V row is loaded and widened once for all G rows. */
static inline __attribute__((always_inline)) void values_z(const char *vh, int kv_bf16, int64_t n,
                                                           int64_t token_bytes, const float *p, int64_t len,
                                                           float *ah, int64_t head_dim, const int G, const int C,
                                                           int64_t d0) {
    const int64_t es = kv_bf16 ? 2 : 4;
    __m512 a[4][4];  /* [g][c] */
    _Pragma("GCC unroll 4") for (int g = 0; g < G; ++g)
        _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(ah + g * head_dim + d0 + 16 * c);
    for (int64_t i = 0; i < n; ++i) {
        const char *vr = vh + i * token_bytes + d0 * es;
        __m512 v[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) v[c] = kv_load16(vr + 16 * c * es, kv_bf16);
        _Pragma("GCC unroll 4") for (int g = 0; g < G; ++g) {
            const __m512 pv = _mm512_set1_ps(p[g * len + i]);
            _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pv, v[c], a[g][c]);
        }
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < G; ++g)
        _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) _mm512_storeu_ps(ah + g * head_dim + d0 + 16 * c, a[g][c]);
}

/* Pass 2 over one block for KV heads [h0, h1), G query heads each. */
static inline __attribute__((always_inline)) void block_values_z(
    const char *vb, int kv_bf16, int64_t n, int64_t t0, int64_t len, int64_t h0, int64_t h1, const int G,
    int64_t head_dim, int64_t token_bytes, const float *scores, float *acc, kv_lines *ahead, int64_t row_lines) {
    const int64_t es = kv_bf16 ? 2 : 4;
    for (int64_t h = h0; h < h1; ++h) {
        kv_lines_fetch(ahead, (n * row_lines + (h1 - h0) - 1) / (h1 - h0));
        const char *vh = vb + h * head_dim * es;
        const float *p = scores + (h - h0) * G * len + t0;
        float *ah = acc + (h - h0) * G * head_dim;
        int64_t d0 = 0;
        for (; d0 + 64 <= head_dim; d0 += 64) values_z(vh, kv_bf16, n, token_bytes, p, len, ah, head_dim, G, 4, d0);
        for (; d0 < head_dim; d0 += 16) values_z(vh, kv_bf16, n, token_bytes, p, len, ah, head_dim, G, 1, d0);
    }
}
#endif

/* One sequence's KV heads [h0, h1) against its `len` tokens; each KV head serves `group` query
 * heads (q row h * group + g, stride q_head_stride; out rows likewise, dense). Rows of all the
 * heads of a token are adjacent in the cache, so reading them together streams whole blocks.
 * token_stride: elements from one token's row to the next (fp32, or bf16 with kv_bf16).
 * scores: scratch of (h1 - h0) * group * len floats; acc: (h1 - h0) * group * head_dim floats;
 * out: the rows of heads [h0, h1)' query heads, from h0 * group's on, dense. */
static void attend(const float *q, int64_t q_head_stride, const void *k_cache, const void *v_cache, int kv_bf16,
                   const int64_t *table, int64_t len, int64_t h0, int64_t h1, int64_t group, int64_t head_dim,
                   int64_t block_size, int64_t token_stride, float scale, float *scores, float *acc,
                   float *out) {
    const int64_t es = kv_bf16 ? 2 : 4;  /* bytes per cache element */
    const int64_t token_bytes = token_stride * es, block_stride = block_size * token_bytes;
    const int64_t rows = (h1 - h0) * group;
    /* Lines of a token's row this call reads, and how many to ask for per row of work so that
     * the prefetches keep pace with the reads (8 tokens per row in pass 1, a block in pass 2). */
    const int64_t row_lines = ((h1 - h0) * head_dim * es + 63) / 64;
    kv_lines ahead = {k_cache, v_cache, table, len, block_size, block_stride, token_bytes,
                      h0 * head_dim * es, h0 * head_dim * es + row_lines * 64, 0, h0 * head_dim * es, NULL};
    kv_lines_seek(&ahead);
    kv_lines_fetch(&ahead, ATTN_AHEAD * row_lines);

    /* 512-bit loops for the usual head shapes: head_dim a multiple of 16, 1, 2 or 4 query heads
     * per KV head; the 256-bit ones for the rest, and for the tokens they leave. */
#ifdef __AVX512F__
    const int zg = head_dim % 16 == 0 && (group == 1 || group == 2 || group == 4) ? (int)group : 0;
#endif

    /* Pass 1: scores, reading each K row once for all the query heads it serves. */
    int64_t t = 0;
#ifdef __AVX512F__
    if (zg == 1)
        t = scores_z(q, q_head_stride, k_cache, kv_bf16, table, len, h0, h1, 1, head_dim, block_size, block_stride,
                     token_bytes, scale, scores, &ahead, row_lines);
    else if (zg == 2)
        t = scores_z(q, q_head_stride, k_cache, kv_bf16, table, len, h0, h1, 2, head_dim, block_size, block_stride,
                     token_bytes, scale, scores, &ahead, row_lines);
    else if (zg == 4)
        t = scores_z(q, q_head_stride, k_cache, kv_bf16, table, len, h0, h1, 4, head_dim, block_size, block_stride,
                     token_bytes, scale, scores, &ahead, row_lines);
#endif
#ifdef HAVE_AVX2
    if (head_dim % 8 == 0) {
        const int64_t per_row_8 = (8 * row_lines + rows - 1) / rows;
        for (; t + 8 <= len; t += 8) {  /* eight tokens at a time: eight independent FMA chains */
            const char *k[8];
            for (int j = 0; j < 8; ++j) k[j] = row(k_cache, table, t + j, block_size, block_stride, token_bytes);
            for (int64_t h = h0; h < h1; ++h) {
                const int64_t o = h * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    kv_lines_fetch(&ahead, per_row_8);
                    const float *qg = q + (h * group + g) * q_head_stride;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                    for (int64_t d = 0; d < head_dim; d += 8) {
                        __m256 qv = _mm256_loadu_ps(qg + d);
                        a0 = _mm256_fmadd_ps(qv, kv_load8(k[0] + (o + d) * es, kv_bf16), a0);
                        a1 = _mm256_fmadd_ps(qv, kv_load8(k[1] + (o + d) * es, kv_bf16), a1);
                        a2 = _mm256_fmadd_ps(qv, kv_load8(k[2] + (o + d) * es, kv_bf16), a2);
                        a3 = _mm256_fmadd_ps(qv, kv_load8(k[3] + (o + d) * es, kv_bf16), a3);
                        a4 = _mm256_fmadd_ps(qv, kv_load8(k[4] + (o + d) * es, kv_bf16), a4);
                        a5 = _mm256_fmadd_ps(qv, kv_load8(k[5] + (o + d) * es, kv_bf16), a5);
                        a6 = _mm256_fmadd_ps(qv, kv_load8(k[6] + (o + d) * es, kv_bf16), a6);
                        a7 = _mm256_fmadd_ps(qv, kv_load8(k[7] + (o + d) * es, kv_bf16), a7);
                    }
                    _mm256_storeu_ps(scores + ((h - h0) * group + g) * len + t,
                                     _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
                }
            }
        }
    }
#endif
    for (; t < len; ++t) {
        const char *k = row(k_cache, table, t, block_size, block_stride, token_bytes);
        kv_lines_fetch(&ahead, row_lines);
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t g = 0; g < group; ++g)
                scores[((h - h0) * group + g) * len + t] =
                    kv_dot(q + (h * group + g) * q_head_stride, k + h * head_dim * es, head_dim, kv_bf16) * scale;
    }

    /* Softmax per query head; the normaliser is applied to the output at the end. */
    float inv_sum[rows];
    for (int64_t r = 0; r < rows; ++r) {
        float *s = scores + r * len;
        float m = s[0];
        for (int64_t i = 1; i < len; ++i) m = s[i] > m ? s[i] : m;
        float sum = 0.0f;
        int64_t i = 0;
#ifdef HAVE_AVX2
        __m256 mv = _mm256_set1_ps(m), sv = _mm256_setzero_ps();
        for (; i + 8 <= len; i += 8) {
            __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
            _mm256_storeu_ps(s + i, e);
            sv = _mm256_add_ps(sv, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, sv);
        for (int j = 0; j < 8; ++j) sum += lanes[j];
#endif
        for (; i < len; ++i) {
            s[i] = expf(s[i] - m);
            sum += s[i];
        }
        inv_sum[r] = 1.0f / sum;
    }

    /* Pass 2: the weighted sum of V, a block at a time (its rows stay in cache across the heads). */
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const char *vb = (const char *)v_cache + table[blk] * block_stride;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
#ifdef __AVX512F__
        if (zg == 1) {
            block_values_z(vb, kv_bf16, n, t0, len, h0, h1, 1, head_dim, token_bytes, scores, acc, &ahead, row_lines);
            continue;
        } else if (zg == 2) {
            block_values_z(vb, kv_bf16, n, t0, len, h0, h1, 2, head_dim, token_bytes, scores, acc, &ahead, row_lines);
            continue;
        } else if (zg == 4) {
            block_values_z(vb, kv_bf16, n, t0, len, h0, h1, 4, head_dim, token_bytes, scores, acc, &ahead, row_lines);
            continue;
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
            kv_lines_fetch(&ahead, (n * row_lines + rows - 1) / rows);
            float *ar = acc + r * head_dim;
            const float *p = scores + r * len + t0;
            const char *vh = vb + (h0 + r / group) * head_dim * es;
            int64_t d = 0;
#ifdef HAVE_AVX2
            for (; d + 32 <= head_dim; d += 32) {  /* four accumulators held across the block's tokens */
                __m256 a0 = _mm256_loadu_ps(ar + d), a1 = _mm256_loadu_ps(ar + d + 8);
                __m256 a2 = _mm256_loadu_ps(ar + d + 16), a3 = _mm256_loadu_ps(ar + d + 24);
                for (int64_t i = 0; i < n; ++i) {
                    const char *v = vh + (i * token_stride + d) * es;
                    __m256 pv = _mm256_set1_ps(p[i]);
                    a0 = _mm256_fmadd_ps(pv, kv_load8(v, kv_bf16), a0);
                    a1 = _mm256_fmadd_ps(pv, kv_load8(v + 8 * es, kv_bf16), a1);
                    a2 = _mm256_fmadd_ps(pv, kv_load8(v + 16 * es, kv_bf16), a2);
                    a3 = _mm256_fmadd_ps(pv, kv_load8(v + 24 * es, kv_bf16), a3);
                }
                _mm256_storeu_ps(ar + d, a0);
                _mm256_storeu_ps(ar + d + 8, a1);
                _mm256_storeu_ps(ar + d + 16, a2);
                _mm256_storeu_ps(ar + d + 24, a3);
            }
#endif
            if (d < head_dim)
                for (int64_t i = 0; i < n; ++i)
                    kv_axpy(ar + d, p[i], vh + (i * token_stride + d) * es, head_dim - d, kv_bf16);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *o = out + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[r * head_dim + d] * inv_sum[r];
    }
}

/* KV heads per attention work item for `batch` sequences on `threads` threads: all of a
 * sequence's (its rows stream whole, where one KV head's slices of them read cold came ~1.25x
 * slower) on one thread or with sequences enough to keep every thread busy; else one, for more
 * items to share. */
static inline int64_t attention_heads_per_item(int64_t batch, int64_t threads, int64_t kv_heads) {
    return threads == 1 || batch >= 4 * threads ? kv_heads : 1;
}

/* Per-thread scratch that outlives the call (OpenMP's threads persist): long contexts need
 * megabytes of scores, and a fresh allocation that size would be page-faulted in on every call.
 * NULL when it cannot grow. */
static float *scratch(int which, int64_t floats) {
    static __thread float *buf[4];
    static __thread int64_t cap[4];
    if (floats > cap[which]) {
        float *grown = realloc(buf[which], sizeof(float) * floats);
        if (grown == NULL) return NULL;
        buf[which] = grown;
        cap[which] = floats;
    }
    return buf[which];
}

/* One thread's part of paged decode attention, inside a parallel region every thread of the team
 * calls it from (its work items are a worksharing loop, whose end is a barrier). Returns 1 when
 * this thread's scratch could not be allocated (its items are then left unwritten), else 0. */
static int attention_part(const float *q, int64_t q_batch_stride, int64_t q_head_stride, const void *k_cache,
                          const void *v_cache, int kv_bf16, const int64_t *block_tables, int64_t table_width,
                          const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; ++b) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    const int64_t heads_per_item = attention_heads_per_item(batch, omp_get_num_threads(), num_kv_heads);
    const int64_t items_per_seq = num_kv_heads / heads_per_item;
    const int64_t rows = heads_per_item * group;
    float *scores = scratch(0, rows * (max_len > 0 ? max_len : 1));
    float *acc = scratch(1, rows * head_dim);
    /* Every thread takes part in the loop (a worksharing construct must be met by all). */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * items_per_seq; ++item) {
        const int64_t b = item / items_per_seq, h0 = (item % items_per_seq) * heads_per_item;
        if (scores == NULL || acc == NULL || seq_lens[b] <= 0) continue;
        attend(q + b * q_batch_stride, q_head_stride, k_cache, v_cache, kv_bf16, block_tables + b * table_width,
               seq_lens[b],
               h0, h0 + heads_per_item, group, head_dim, block_size, token_stride, scale, scores, acc,
               out + b * num_heads * head_dim + h0 * group * head_dim);
    }
    return scores == NULL || acc == NULL;
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int pdserve_paged_decode_attention_f32(const float *q, int64_t q_batch_stride, int64_t q_head_stride,
                                       const void *k_cache, const void *v_cache, int kv_bf16,
                                       const int64_t *block_tables,
                                       int64_t table_width, const int64_t *seq_lens, float *out, int64_t batch,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    failed = attention_part(q, q_batch_stride, q_head_stride, k_cache, v_cache, kv_bf16, block_tables, table_width,
                            seq_lens, out, batch, num_heads, num_kv_heads, head_dim, block_size, scale);
    return failed;
}

/* -- Elementwise kernels of the decoder layer ---------------------------------------------------
 * Each replaces a handful of torch ops (and their temporaries) with one pass over the rows; a
 * decode step runs them 2-3 times per layer, so the per-op cost of torch adds up at small
 * batches. Rows of `dim` floats, dense. Parallel over rows only when there is enough work. */

#define PARALLEL_MIN_ELEMS (1 << 15)

static inline float sum_of_squares(const float *x, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
    return acc;
}

/* One row: out = x / sqrt(mean(x^2) + eps) * weight; with `delta`, first x += delta (the residual add). */
static inline void rms_norm_row(float *x, const float *delta, const float *weight, float *out, int64_t dim,
                                float eps) {
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

void pdserve_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * dim, out + r * dim, dim);
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

/* x: [tokens, *, head_dim] with token stride `token_stride`; cos_sin: [tokens, 2, head_dim / 2]. */
void pdserve_rotary_f32(float *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
                        const float *cos_sin, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; ++t) rotary_token(x + t * token_stride, heads, head_dim, cos_sin + t * head_dim);
}

/* -- Linear layers: y = x W^T + b over W packed in column panels ---------------------------------
 * oneDNN's and MKL's matmuls are built for large problems; at decode batch sizes (1-64 rows) they
 * stream these models' weights at 60-75% of what the memory can deliver. The packed layout here
 * stores W `[N, K]` as panels of 16 output columns, `[ceil(N / 16), K, 16]` (zero-padded), so:
 * - one row of x (batch-1 decode) reads the weights as one contiguous stream per thread;
 * - several rows use register tiles: with AVX2 up to 6 x 16 (per k, two weight vectors and six
 *   broadcasts of x feed twelve FMAs), with AVX-512 up to 12 x 16 (one weight vector, twelve
 *   FMAs of twice the width: 2x the rows per cycle), so from a few rows on the loop runs at the
 *   cores' FMA rate, not the memory's; a panel (16 x K weights) stays in cache while every row
 *   block passes over it.
 * Threads split the panels; rows are taken in blocks whose x fits in L2 (prefill chunks). */

#define PANEL 16

/* Ask the kernel for 2 MiB pages under `bytes` at p (the whole 2 MiB pages inside it), before
 * anything touches them. With 4 KiB pages a GEMV takes a TLB miss every 4 KiB and the hardware
 * prefetcher restarts at each page boundary; this machine class has transparent huge pages only
 * on request ("madvise"). Best effort: where the kernel says no, nothing changes. */
void pdserve_want_huge_pages(void *p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* Pack an fp32 [n, k] weight into column panels [ceil(n / 16), k, 16], zero-padded: fp32, or with
 * `bf16` rounded to bf16 (nearest even, as torch rounds), which halves the bytes a matmul streams. */
void pdserve_pack_linear_f32(const float *w, int64_t n, int64_t k, void *packed, int bf16, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    pdserve_want_huge_pages(packed, (bf16 ? 2 : 4) * panels * PANEL * k);
#pragma omp parallel for num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        for (int64_t j = 0; j < PANEL; ++j) {
            const int64_t col = p * PANEL + j;
            for (int64_t i = 0; i < k; ++i) {
                const float v = col < n ? w[col * k + i] : 0.0f;
                const int64_t at = p * k * PANEL + i * PANEL + j;
                if (bf16)
                    ((uint16_t *)packed)[at] = float_to_bf16(v);
                else
                    ((float *)packed)[at] = v;
            }
        }
    }
}

/* Write the first `cols` columns of a 16-column result row (+ bias). */
static inline void store_row(float *out, const float *vals, int64_t cols, const float *bias) {
    for (int64_t j = 0; j < cols; ++j) out[j] = vals[j] + (bias != NULL ? bias[j] : 0.0f);
}

/* A packed panel's row i (16 columns) holds fp32, or bf16 with `wbf16` (widened exactly to fp32,
 * so a bf16 panel's product is the fp32 product over the rounded weights, bit for bit). Every
 * function taking `wbf16` is inlined into callers that pass a constant, so each kind of panel
 * gets its own loops. */
static inline __attribute__((always_inline)) float panel_at(const void *panel, int64_t i, int wbf16) {
    return wbf16 ? bf16_to_float(((const uint16_t *)panel)[i]) : ((const float *)panel)[i];
}

/* Ask for the panel's bytes PANEL_AHEAD_BYTES ahead of row i (into the next panels: a matmul reads
 * its panels in order). The hardware prefetcher alone kept a tile of 8 rows waiting on its weights
 * (a one-thread decode step of 8 sequences took 1.5x as long; 12 KiB ahead measured best of
 * 0.75-24 KiB, fp32 and bf16 alike; benchmarks/RESULTS.md). */
#define PANEL_AHEAD_BYTES 12288
static inline __attribute__((always_inline)) void panel_prefetch(const void *panel, int64_t i, int wbf16) {
    __builtin_prefetch((const char *)panel + i * PANEL * (wbf16 ? 2 : 4) + PANEL_AHEAD_BYTES, 0, 3);
}

#ifdef HAVE_AVX2
static inline __attribute__((always_inline)) __m256 panel_load8(const void *panel, int64_t i, int wbf16) {
    return kv_load8((const char *)panel + i * (wbf16 ? 2 : 4), wbf16);
}

/* store_row for a result row held in two registers; whole panels store straight from them. */
static inline void store_16(float *out, __m256 lo, __m256 hi, int64_t cols, const float *bias) {
    if (cols < PANEL) {
        float vals[PANEL];
        _mm256_storeu_ps(vals, lo);
        _mm256_storeu_ps(vals + 8, hi);
        store_row(out, vals, cols, bias);
        return;
    }
    if (bias != NULL) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
}

/* Rows [0, MR) of x (row stride ldx) times one panel -> out rows (stride ldo), `cols` columns. */
#define LINEAR_TILE(MR)                                                                               \
    static inline __attribute__((always_inline)) void linear_tile_##MR(                             \
        const float *x, int64_t ldx, const void *panel, int wbf16, int64_t k, float *out, int64_t ldo, \
        int64_t cols, const float *bias) {                                                           \
        /* Every loop over r is unrolled, so the accumulators live in registers (a loop left     \
         * rolled makes GCC keep them in memory and store them on every k: half the speed). */  \
        __m256 lo[MR], hi[MR];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {                                      \
            lo[r] = _mm256_setzero_ps();                                                             \
            hi[r] = _mm256_setzero_ps();                                                             \
        }                                                                                            \
        for (int64_t i = 0; i < k; ++i) {                                                            \
            panel_prefetch(panel, i, wbf16);                                                         \
            const __m256 w0 = panel_load8(panel, i * PANEL, wbf16), w1 = panel_load8(panel, i * PANEL + 8, wbf16); \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {                                  \
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);                              \
                lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);                                              \
                hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);                                              \
            }                                                                                        \
        }                                                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) store_16(out + r * ldo, lo[r], hi[r], cols, bias); \
    }
LINEAR_TILE(6)
LINEAR_TILE(5)
LINEAR_TILE(4)
LINEAR_TILE(3)
LINEAR_TILE(2)
LINEAR_TILE(1)

#ifdef __AVX512F__
#define HAVE_AVX512 1
/* The same tiles with a whole panel in one 512-bit register: one FMA per row and k instead of
 * two, and 32 registers, so a tile takes up to 12 rows (16 measured slower). */
static inline __attribute__((always_inline)) __m512 panel_load16(const void *panel, int64_t i, int wbf16) {
    if (!wbf16) return _mm512_loadu_ps((const float *)panel + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_16z(float *out, __m512 v, int64_t cols, const float *bias) {
    const __mmask16 mask = cols < PANEL ? (__mmask16)((1u << cols) - 1) : (__mmask16)0xffff;
    if (bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(out, mask, v);
}

#define LINEAR_ZTILE(MR)                                                                              \
    static inline __attribute__((always_inline)) void linear_ztile_##MR(                            \
        const float *x, int64_t ldx, const void *panel, int wbf16, int64_t k, float *out, int64_t ldo, \
        int64_t cols, const float *bias) {                                                           \
        __m512 acc[MR];                                                                              \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();         \
        for (int64_t i = 0; i < k; ++i) {                                                            \
            panel_prefetch(panel, i, wbf16);                                                         \
            const __m512 w = panel_load16(panel, i * PANEL, wbf16);                                  \
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; ++r)                                   \
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + i]), w, acc[r]);                 \
        }                                                                                            \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; ++r) store_16z(out + r * ldo, acc[r], cols, bias); \
    }
LINEAR_ZTILE(12) LINEAR_ZTILE(11) LINEAR_ZTILE(10) LINEAR_ZTILE(9) LINEAR_ZTILE(8) LINEAR_ZTILE(7)
LINEAR_ZTILE(6) LINEAR_ZTILE(5) LINEAR_ZTILE(4) LINEAR_ZTILE(3) LINEAR_ZTILE(2) LINEAR_ZTILE(1)
#endif

/* One row of x: two k at a time, four independent FMA chains (memory-bound: keep loads in flight). */
static inline __attribute__((always_inline)) void linear_row(const float *x, const void *panel, int wbf16,
                                                           int64_t k, float *out, int64_t cols, const float *bias) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t i = 0;
    for (; i + 2 <= k; i += 2) {
        const __m256 x0 = _mm256_broadcast_ss(x + i), x1 = _mm256_broadcast_ss(x + i + 1);
        panel_prefetch(panel, i, wbf16);
        if (!wbf16) panel_prefetch(panel, i + 1, wbf16);  /* two rows: two lines of fp32, one of bf16 */
        a0 = _mm256_fmadd_ps(x0, panel_load8(panel, i * PANEL, wbf16), a0);
        a1 = _mm256_fmadd_ps(x0, panel_load8(panel, i * PANEL + 8, wbf16), a1);
        b0 = _mm256_fmadd_ps(x1, panel_load8(panel, i * PANEL + 16, wbf16), b0);
        b1 = _mm256_fmadd_ps(x1, panel_load8(panel, i * PANEL + 24, wbf16), b1);
    }
    if (i < k) {
        const __m256 x0 = _mm256_broadcast_ss(x + i);
        a0 = _mm256_fmadd_ps(x0, panel_load8(panel, i * PANEL, wbf16), a0);
        a1 = _mm256_fmadd_ps(x0, panel_load8(panel, i * PANEL + 8, wbf16), a1);
    }
    store_16(out, _mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), cols, bias);
}
#endif

#ifndef HAVE_AVX2
/* Plain C for CPUs without AVX2/FMA (the compiler vectorises the inner loop). */
static inline __attribute__((always_inline)) void linear_rows_portable(const float *x, int64_t rows, int64_t k,
                                                                      const void *panel, int wbf16, float *out,
                                                                      int64_t ldo, int64_t cols, const float *bias) {
    for (int64_t r = 0; r < rows; ++r) {
        float vals[PANEL] = {0};
        for (int64_t i = 0; i < k; ++i) {
            const float xv = x[r * k + i];
#pragma omp simd
            for (int j = 0; j < PANEL; ++j) vals[j] += xv * panel_at(panel, i * PANEL + j, wbf16);
        }
        store_row(out + r * ldo, vals, cols, bias);
    }
}
#endif

/* Rows [0, m) of x (row stride k) times one panel, in register tiles. A tile's rows are its
 * independent FMA chains: a tile of few rows waits on the FMAs' latency, so the rows go in as few
 * tiles as fit the registers (with AVX-512 a decode batch of up to 12 rows is one tile; with AVX2,
 * 3 or 5 rows no longer run as 2 + 1 or 4 + 1). Every tile adds a row's products in the same
 * order, so how a batch is tiled does not change a row's result. */
static inline __attribute__((always_inline)) void linear_tiles(const float *x, int64_t m, int64_t k,
                                                              const void *panel, int wbf16, float *out, int64_t ldo,
                                                              int64_t cols, const float *bias) {
#if defined(HAVE_AVX512)
    /* ceil(m / 12) tiles, as even as they can be: a tile of 2 to 6 rows measured as slow as one
     * of 6 (the FMAs' latency), and from 8 rows on a tile runs at the FMAs' rate. */
    for (int64_t r = 0; r < m;) {
        const int64_t left = m - r, tiles = (left + 11) / 12, rows = (left + tiles - 1) / tiles;
        const float *xr = x + r * k;
        float *o = out + r * ldo;
#define ZTILE(MR) case MR: linear_ztile_##MR(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        switch (rows) {
        ZTILE(12) ZTILE(11) ZTILE(10) ZTILE(9) ZTILE(8) ZTILE(7) ZTILE(6) ZTILE(5) ZTILE(4) ZTILE(3) ZTILE(2)
        default: linear_ztile_1(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        }
#undef ZTILE
        r += rows;
    }
#elif defined(HAVE_AVX2)
    /* Tiles of 6 rows, then the rest as one (6 + 1 measured faster than 4 + 3 here). */
    for (int64_t r = 0; r < m; r += 6) {
        const float *xr = x + r * k;
        float *o = out + r * ldo;
        switch (m - r < 6 ? m - r : 6) {
        case 6: linear_tile_6(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        case 5: linear_tile_5(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        case 4: linear_tile_4(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        case 3: linear_tile_3(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        case 2: linear_tile_2(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        default: linear_tile_1(xr, k, panel, wbf16, k, o, ldo, cols, bias); break;
        }
    }
#else
    linear_rows_portable(x, m, k, panel, wbf16, out, ldo, cols, bias);
#endif
}

/* Thread t of nt's share [*p0, *p1) of the panels of an [m, k] x [k, n] product: an even split, or
 * all of them on thread 0 when the product is too small to share (or to pay for waking threads). */
static void part_panels(int64_t m, int64_t k, int64_t n, int t, int nt, int64_t *p0, int64_t *p1) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    if (m * n * k < (1 << 16)) {
        *p0 = 0;
        *p1 = t == 0 ? panels : 0;
        return;
    }
    *p0 = panels * t / nt;
    *p1 = panels * (t + 1) / nt;
}

/* Rows [0, m) of x (row stride k) times panels [p0, p1) of a packed weight of n columns -> out
 * (row stride ldo) from panel p0's columns on, + bias (from column 0). One row alone goes through
 * linear_row; `whole_m` is the product's row count (a block of one row of a larger product stays in
 * a tile, so a row's result does not depend on its batch). */
static inline __attribute__((always_inline)) void panels_product(const float *x, int64_t m, int64_t whole_m,
                                                                int64_t k, const void *packed, int wbf16,
                                                                int64_t p0, int64_t p1, int64_t n,
                                                                const float *bias, float *out, int64_t ldo) {
    for (int64_t q = p0; q < p1; ++q) {
        const void *panel = (const char *)packed + q * k * PANEL * (wbf16 ? 2 : 4);
        const int64_t c = q * PANEL, cols = n - c < PANEL ? n - c : PANEL;
        const float *b = bias != NULL ? bias + c : NULL;
        float *o = out + (q - p0) * PANEL;
#ifdef HAVE_AVX2
        if (whole_m == 1) {
            linear_row(x, panel, wbf16, k, o, cols, b);
            continue;
        }
#else
        (void)whole_m;
#endif
        linear_tiles(x, m, k, panel, wbf16, o, ldo, cols, b);
    }
}

/* panels_product for each kind of panel. */
static void panels_product_any(const float *x, int64_t m, int64_t whole_m, int64_t k, const void *packed, int wbf16,
                               int64_t p0, int64_t p1, int64_t n, const float *bias, float *out, int64_t ldo) {
    if (wbf16)
        panels_product(x, m, whole_m, k, packed, 1, p0, p1, n, bias, out, ldo);
    else
        panels_product(x, m, whole_m, k, packed, 0, p0, p1, n, bias, out, ldo);
}

/* Thread t of nt's part of out [m, n] = x [m, k] (dense) @ W^T (+ bias [n]): its share of the panels. */
static void linear_part(const float *x, int64_t m, int64_t k, const void *packed, int wbf16, int64_t n,
                        const float *bias, float *out, int t, int nt) {
    /* Rows per block: x's block (block * k floats) takes half of a 512 KiB L2; a multiple of 12
     * (whole tiles of 6 or 12 rows). */
    int64_t block = (64 * 1024) / (k > 0 ? k : 1);
    block = block < 12 ? 12 : block - block % 12;
    int64_t p0, p1;
    part_panels(m, k, n, t, nt, &p0, &p1);
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        const int64_t m1 = m0 + block < m ? m0 + block : m;
        panels_product_any(x + m0 * k, m1 - m0, m, k, packed, wbf16, p0, p1, n, bias, out + m0 * n + p0 * PANEL, n);
    }
}

/* out [m, n] = x [m, k] (dense) @ W^T (+ bias [n]), W packed by pdserve_pack_linear_f32 (bf16
 * panels with `wbf16`). */
void pdserve_linear_f32(const float *x, int64_t m, int64_t k, const void *packed, int wbf16, int64_t n,
                        const float *bias, float *out, int num_threads) {
    if (m * n * k < (1 << 16)) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    linear_part(x, m, k, packed, wbf16, n, bias, out, omp_get_thread_num(), omp_get_num_threads());
}

/* -- Prefill attention ---------------------------------------------------------------------------
 * One sequence's chunk of q_len queries at positions [context_len - q_len, context_len), causal
 * over the K and V of positions [0, context_len) in the paged cache (the chunk's own are written
 * there first, so this reads them as the cache holds them, like every other path). Per KV head,
 * its K is widened into panels as a linear layer's weight of context_len outputs and its V, as
 * V^T's, one of head_dim outputs, so both products run on the matmul tiles above; then per block
 * of PREFILL_Q_TOKENS query tokens: the scores of the group's query heads for the keys up to the
 * block's last position, an exact softmax per row (a row holds at most context_len scores, so no
 * running rescale is needed), and scores @ V. Masked keys cost at most a block's width per row;
 * torch's CPU flash attention skips them only in 256 x 512 tiles (on a Zen 3 core it ran a causal
 * 1,280-token prefill at 45 GFLOP/s against 70 for the same shapes unmasked). */
#define PREFILL_Q_TOKENS 24

/* K of one KV head, tokens [0, len), as a packed weight: [len_pad / 16][head_dim][16], zero past len. */
static void pack_keys(const char *k_cache, int kv_bf16, const int64_t *table, int64_t len, int64_t len_pad,
                      int64_t block_size, int64_t block_stride, int64_t token_bytes, int64_t head_off,
                      int64_t head_dim, float *out) {
    for (int64_t t = 0; t < len_pad; ++t) {
        float *dst = out + (t / PANEL) * head_dim * PANEL + t % PANEL;
        const char *src = t < len ? row(k_cache, table, t, block_size, block_stride, token_bytes) + head_off : NULL;
        for (int64_t d = 0; d < head_dim; ++d) dst[d * PANEL] = src != NULL ? kv_at(src, d, kv_bf16) : 0.0f;
    }
}

/* V of one KV head, tokens [0, len), as V^T's packed weight: [ceil(head_dim / 16)][len_pad][16]. */
static void pack_values(const char *v_cache, int kv_bf16, const int64_t *table, int64_t len, int64_t len_pad,
                        int64_t block_size, int64_t block_stride, int64_t token_bytes, int64_t head_off,
                        int64_t head_dim, float *out) {
    const int64_t dims = (head_dim + PANEL - 1) / PANEL * PANEL;
    for (int64_t t = 0; t < len_pad; ++t) {
        const char *src = t < len ? row(v_cache, table, t, block_size, block_stride, token_bytes) + head_off : NULL;
        for (int64_t d = 0; d < dims; ++d)
            out[(d / PANEL) * len_pad * PANEL + t * PANEL + d % PANEL] =
                src != NULL && d < head_dim ? kv_at(src, d, kv_bf16) : 0.0f;
    }
}

/* Softmax of s[0, n) in place (s[n, width) zeroed); returns 1 / the sum of the exponentials. */
static float softmax_row(float *s, int64_t n, int64_t width) {
    float max = -INFINITY, sum = 0.0f;
    int64_t j = 0;
#ifdef HAVE_AVX2
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; ++i) max = lanes[i] > max ? lanes[i] : max;
#endif
    for (; j < n; ++j) max = s[j] > max ? s[j] : max;
    j = 0;
#ifdef HAVE_AVX2
    __m256 acc = _mm256_setzero_ps();
    mv = _mm256_set1_ps(max);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
    for (; j < n; ++j) sum += (s[j] = expf(s[j] - max));
    for (j = n; j < width; ++j) s[j] = 0.0f;
    return 1.0f / sum;
}

/* One KV head's share of the chunk (its panels packed in kp, vp): out rows of the group's query heads. */
static void prefill_head(const float *q, int64_t q_token_stride, int64_t q_head_stride, int64_t q_len,
                         int64_t context_len, int64_t kv_head, int64_t group, int64_t head_dim, float scale,
                         const float *kp, const float *vp, int64_t len_pad, float *qs, float *scores, float *acc,
                         float *out, int64_t out_token_stride) {
    const int64_t first_pos = context_len - q_len, dims = (head_dim + PANEL - 1) / PANEL * PANEL;
    float *inv = acc + PREFILL_Q_TOKENS * group * dims;
    for (int64_t i0 = 0; i0 < q_len; i0 += PREFILL_Q_TOKENS) {
        const int64_t i1 = i0 + PREFILL_Q_TOKENS < q_len ? i0 + PREFILL_Q_TOKENS : q_len, rows = (i1 - i0) * group;
        const int64_t keys = (first_pos + i1 + PANEL - 1) / PANEL * PANEL;  /* the block's last query sees fewer */
        /* Row r: query token i0 + r / group, head kv_head * group + r % group, scaled. */
        for (int64_t r = 0; r < rows; ++r) {
            const float *src = q + (i0 + r / group) * q_token_stride + (kv_head * group + r % group) * q_head_stride;
            for (int64_t d = 0; d < head_dim; ++d) qs[r * head_dim + d] = src[d] * scale;
        }
        panels_product(qs, rows, rows, head_dim, kp, 0, 0, keys / PANEL, keys, NULL, scores, keys);
        for (int64_t r = 0; r < rows; ++r)
            inv[r] = softmax_row(scores + r * keys, first_pos + i0 + r / group + 1, keys);
        for (int64_t p = 0; p < dims / PANEL; ++p) {
            const int64_t cols = head_dim - p * PANEL < PANEL ? head_dim - p * PANEL : PANEL;
            linear_tiles(scores, rows, keys, vp + p * len_pad * PANEL, 0, acc + p * PANEL, dims, cols, NULL);
        }
        for (int64_t r = 0; r < rows; ++r) {
            float *dst = out + (i0 + r / group) * out_token_stride + (kv_head * group + r % group) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[r * dims + d] * inv[r];
        }
    }
}

/* out [q_len, num_heads, head_dim] (token stride out_token_stride): see the section's comment. The
 * KV heads are shared among the threads (a thread packs its own). Returns 0 on success, 1 when
 * scratch memory could not be allocated. */
int pdserve_paged_prefill_attention_f32(const float *q, int64_t q_token_stride, int64_t q_head_stride,
                                        const void *k_cache, const void *v_cache, int kv_bf16, const int64_t *table,
                                        int64_t context_len, int64_t q_len, float *out, int64_t out_token_stride,
                                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                        int64_t block_size, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads, es = kv_bf16 ? 2 : 4;
    const int64_t token_bytes = num_kv_heads * head_dim * es, block_stride = block_size * token_bytes;
    const int64_t len_pad = (context_len + PANEL - 1) / PANEL * PANEL;
    const int64_t dims = (head_dim + PANEL - 1) / PANEL * PANEL, max_rows = PREFILL_Q_TOKENS * group;
    if (num_threads > num_kv_heads) num_threads = (int)num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *kp = scratch(2, len_pad * head_dim), *vp = scratch(3, dims * len_pad);
        float *scores = scratch(0, max_rows * len_pad), *qs = scratch(1, max_rows * (head_dim + dims + 1));
        failed = kp == NULL || vp == NULL || scores == NULL || qs == NULL;
#pragma omp for schedule(static)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            if (failed) continue;
            pack_keys(k_cache, kv_bf16, table, context_len, len_pad, block_size, block_stride, token_bytes,
                      h * head_dim * es, head_dim, kp);
            pack_values(v_cache, kv_bf16, table, context_len, len_pad, block_size, block_stride, token_bytes,
                        h * head_dim * es, head_dim, vp);
            prefill_head(q, q_token_stride, q_head_stride, q_len, context_len, h, group, head_dim, scale, kp, vp,
                         len_pad, qs, scores, qs + max_rows * head_dim, out, out_token_stride);
        }
    }
    return failed;
}

/* -- A whole decode step in one call, on threads that never wait for a descheduled one ------------
 * Called one by one from Python, a layer's eleven kernels pay for module calls, views, checks and
 * ctypes between them. For a dense Llama-family model in fp32 with every linear packed for
 * pdserve_linear_f32 (fp32 or bf16 panels, all alike), a decode-only step (one new token per
 * sequence, every row sampled) runs here from token ids to logits, with the same row functions and
 * matmul tiles as those kernels:
 *   h = embedding[id]; per layer:
 *     x = norm(h); qkv = x Wqkv (+b); rotary(q, k); cache[slot] = k, v; a = attention(q);
 *     h += a Wo; x = norm(h); h += (silu(x Wg) * x Wu) Wd
 *   logits = norm(h) Wlm, and with greedy sampling each row's argmax.
 *
 * Its threads share the work without ever waiting on one another. A serving replica's engine
 * shares its cores with the gateway, Ray and the network stack; split statically with a barrier
 * after every kernel (OpenMP), a step stalls for as long as any one of its threads is descheduled:
 * on 2 cores, served steps took ~1.25x their offline time, while a one-thread engine served at
 * its offline speed. Here:
 * - A step is a sequence of phases (per layer: norm, qkv, rotary, attention, o, norm, gate_up,
 *   silu, down; then the final norm, the LM head and the argmax), each a set of independent
 *   items: rows, (row, KV head) pairs, or a few column panels of a matmul (`item_bytes` of weights
 *   each: ~128 KiB, ~5 us of streaming, pays for its two CASes many times over).
 * - Thread t takes its share of a phase's items from the front, then what is left of the other
 *   shares from their ends: a thread that is descheduled, or late to wake, just does less.
 * - An item is computed into the thread's own buffers, then published: a CAS on the item's state
 *   word (claimed -> storing) lets exactly one thread write its outputs. A thread that has waited
 *   too long for an item another thread claimed computes it too, and the first to publish wins.
 * - Threads write shared memory only inside a publish, and every state word carries its step's
 *   tag: a thread that resumes after its step has ended fails its CAS and drops what it computed.
 *   What it may still read stays valid: the step's inputs are copied and checked into buffers the
 *   decoder owns, laid out by capacity (never by the step's size), and buffers replaced when the
 *   capacity grows are freed only with the decoder. It never reads the caller's memory.
 * - The caller (thread 0) returns once every item of the last phase is published. The helpers
 *   are the decoder's own threads; they spin for SPIN_NS after a step, then sleep on a futex.
 * Each item is computed the same way whichever thread computes it, so results do not depend on
 * the thread count or on who did what. */

typedef struct {
    const float *input_norm, *post_norm;                  /* [hidden] */
    const void *qkv;                                      /* packed (pdserve_pack_linear_f32), as o to down */
    const float *qkv_bias;                                /* may be NULL */
    const void *o, *gate_up, *down;
    void *k_cache, *v_cache;                              /* [num_blocks, block_size, kv_heads, head_dim], dense */
} pdserve_decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, vocab;
    int64_t num_blocks, max_position;  /* the KV cache's blocks; the rotary table's rows */
    int64_t kv_bf16;                   /* the cache holds bf16 (else fp32) */
    int64_t weight_bf16;               /* the packed weights hold bf16 (else fp32) */
    float eps, scale;
} pdserve_decoder_shape;

typedef struct {
    const pdserve_decoder_layer *layers;
    int64_t num_layers;
    const float *embedding;   /* [vocab rows, hidden], dense */
    const float *cos_sin;     /* [max_position, 2, head_dim / 2]: the rotary table */
    const float *final_norm;  /* [hidden] */
    const void *lm_head;      /* packed, `vocab` output columns */
} pdserve_decoder_model;

#define SPIN_NS 50000                  /* a helper spins this long after a step before it sleeps */
#define REDO_MIN_NS 20000              /* wait at least this long before redoing another thread's item */
#define MAX_THREADS 255                /* thread index: 8 bits of a state word */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* Phases: nine per layer, then three. */
enum { K_NORM_IN, K_QKV, K_ROTARY, K_ATTN, K_O, K_NORM_POST, K_GATE_UP, K_SILU, K_DOWN, K_LAYER_KINDS,
       K_NORM_FINAL = K_LAYER_KINDS, K_LM_HEAD, K_ARGMAX, K_KINDS };

/* An item's state word: the step's tag (48 bits), the state, the thread that set it. */
enum { ST_FREE, ST_CLAIMED, ST_STORING, ST_DONE };
static inline uint64_t state_word(uint64_t tag, int state, int who) {
    return tag << 16 | (uint64_t)state << 8 | (uint64_t)who;
}
static inline int state_of(uint64_t w) { return (int)(w >> 8 & 0xff); }
static inline int who_of(uint64_t w) { return (int)(w & 0xff); }
static inline int tagged(uint64_t w, uint64_t tag) { return (w >> 16) == (tag & 0xffffffffffffull); }

typedef struct { /* a thread's own buffers, for one item at a time */
    float *tile;           /* [m_cap, tile_cols]: a matmul item's result */
    float *row_a, *row_b;  /* a row: max(hidden, qkv, intermediate) and hidden floats */
    float *scores, *acc;   /* attention: [heads, max_len], [heads, head_dim] */
    int64_t *best_index;   /* [m_cap]: an LM-head item's argmax per row, and its value */
    float *best_value;
} thread_buffers;

typedef struct buffers { /* everything a step touches besides weights and cache, sized by capacity */
    int64_t m_cap, w_cap, nt_cap;
    int64_t *ids, *positions, *slots, *lens, *tables;  /* tables [m_cap, w_cap] */
    float *h, *x, *qkv, *attn, *o_out, *gate_up, *act, *down_out;
    int64_t *best_index;  /* [LM-head items, m_cap] */
    float *best_value;
    _Atomic uint64_t *states;
    thread_buffers *threads;  /* [nt_cap] */
    struct buffers *retired;  /* the buffers these replaced */
    void *memory;
} buffers;

typedef struct { /* one step as a thread sees it: a consistent snapshot */
    uint64_t tag;
    int64_t m, nt;
    buffers *buf;
    float *logits;
    int64_t *greedy;
} step_params;

struct pdserve_decoder;

typedef struct {
    struct pdserve_decoder *dec;
    int index;
    pthread_t thread;
    uint64_t rng;              /* chaos (tests) */
    int64_t argmax;            /* an argmax item's result */
    int64_t item_ns[K_KINDS];  /* this thread's latest time per item of each kind */
} __attribute__((aligned(64))) worker;  /* whole cache lines: each thread writes its own */

typedef struct pdserve_decoder {
    pdserve_decoder_model model;
    pdserve_decoder_layer *layers;
    pdserve_decoder_shape s;
    int64_t q_size, kv_size, qkv_size, group, item_bytes;
    buffers *buf;       /* the caller's: current buffers */
    uint64_t last_tag;  /* the caller's */
    /* The current step, for helpers: a seqlock (pseq odd while the caller writes). */
    _Atomic uint64_t pseq, p_tag;
    _Atomic int64_t p_m, p_nt;
    _Atomic(buffers *) p_buf;
    _Atomic(float *) p_logits;
    _Atomic(int64_t *) p_greedy;
    _Atomic uint32_t wake;  /* futex word: the newest tag's low 32 bits */
    _Atomic int sleepers, quit;
    worker *workers[MAX_THREADS];  /* [0]: the caller's */
    int num_workers;
    _Atomic int64_t stats[4];  /* steps, stolen, redone, dropped */
    _Atomic int chaos_permille, chaos_max_us;
} pdserve_decoder;

enum { STAT_STEPS, STAT_STOLEN, STAT_REDONE, STAT_DROPPED };

static int64_t argmax_row(const float *v, int64_t n);

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void stat_add(pdserve_decoder *d, int which) { atomic_fetch_add_explicit(&d->stats[which], 1, memory_order_relaxed); }

/* -- Shapes of the work ----------------------------------------------------------------------- */
static int64_t panels_per_item(const pdserve_decoder *d, int64_t k) {
    const int64_t p = d->item_bytes / (k * PANEL * (d->s.weight_bf16 ? 2 : 4));
    return p > 0 ? p : 1;
}

static int64_t matmul_items(const pdserve_decoder *d, int64_t n, int64_t k) {
    const int64_t panels = (n + PANEL - 1) / PANEL, per = panels_per_item(d, k);
    return (panels + per - 1) / per;
}

typedef struct { const float *x; int64_t k; const void *w; int64_t n; const float *bias; float *out; } matmul;

static matmul matmul_of(const pdserve_decoder *d, const step_params *p, int kind, int64_t layer) {
    const pdserve_decoder_shape *s = &d->s;
    const buffers *b = p->buf;
    const pdserve_decoder_layer *l = &d->layers[layer < d->model.num_layers ? layer : 0];
    switch (kind) {
    case K_QKV: return (matmul){b->x, s->hidden, l->qkv, d->qkv_size, l->qkv_bias, b->qkv};
    case K_O: return (matmul){b->attn, d->q_size, l->o, s->hidden, NULL, b->o_out};
    case K_GATE_UP: return (matmul){b->x, s->hidden, l->gate_up, 2 * s->intermediate, NULL, b->gate_up};
    case K_DOWN: return (matmul){b->act, s->intermediate, l->down, s->hidden, NULL, b->down_out};
    default: return (matmul){b->x, s->hidden, d->model.lm_head, s->vocab, NULL, p->logits};
    }
}

/* Items in a phase of each kind, for m rows with `attn_heads` KV heads per attention item. */
static void count_items(const pdserve_decoder *d, int64_t m, int greedy, int64_t attn_heads, int64_t counts[K_KINDS]) {
    const pdserve_decoder_shape *s = &d->s;
    counts[K_NORM_IN] = counts[K_ROTARY] = counts[K_NORM_POST] = counts[K_SILU] = counts[K_NORM_FINAL] = m;
    counts[K_ATTN] = m * (s->kv_heads / attn_heads);
    counts[K_QKV] = matmul_items(d, d->qkv_size, s->hidden);
    counts[K_O] = matmul_items(d, s->hidden, d->q_size);
    counts[K_GATE_UP] = matmul_items(d, 2 * s->intermediate, s->hidden);
    counts[K_DOWN] = matmul_items(d, s->hidden, s->intermediate);
    counts[K_LM_HEAD] = matmul_items(d, s->vocab, s->hidden);
    counts[K_ARGMAX] = greedy ? m : 0;
}

/* At most: one KV head per attention item. */
static int64_t total_items(const pdserve_decoder *d, int64_t m) {
    int64_t c[K_KINDS], layer = 0;
    count_items(d, m, 1, 1, c);
    for (int k = 0; k < K_LAYER_KINDS; ++k) layer += c[k];
    return d->model.num_layers * layer + c[K_NORM_FINAL] + c[K_LM_HEAD] + c[K_ARGMAX];
}

/* -- Items: computed into the thread's buffers, then published ---------------------------------- */
typedef struct { int kind; int64_t layer, n, offset; } phase;

/* Attention item i of step p: row *r's query heads of KV heads [*g, *g + *heads). */
static void attention_item(const pdserve_decoder *d, const step_params *p, int64_t i, int64_t *r, int64_t *g,
                           int64_t *heads) {
    *heads = attention_heads_per_item(p->m, p->nt, d->s.kv_heads);
    const int64_t per_row = d->s.kv_heads / *heads;
    *r = i / per_row;
    *g = i % per_row * *heads;
}

static void compute_item(const pdserve_decoder *d, worker *w, const step_params *p, const phase *f, int64_t i) {
    const pdserve_decoder_shape *s = &d->s;
    const buffers *b = p->buf;
    thread_buffers *t = &b->threads[w->index];
    const pdserve_decoder_layer *l = &d->layers[f->layer < d->model.num_layers ? f->layer : 0];
    switch (f->kind) {
    case K_NORM_IN:
    case K_NORM_POST:
    case K_NORM_FINAL: {  /* h += the last sublayer's output; x = norm(h) */
        const float *delta = f->kind == K_NORM_POST ? b->o_out : f->layer > 0 ? b->down_out : NULL;
        const float *weight = f->kind == K_NORM_IN ? l->input_norm : f->kind == K_NORM_POST ? l->post_norm
                                                                                           : d->model.final_norm;
        memcpy(t->row_a, b->h + i * s->hidden, sizeof(float) * s->hidden);
        rms_norm_row(t->row_a, delta != NULL ? delta + i * s->hidden : NULL, weight, t->row_b, s->hidden, s->eps);
        break;
    }
    case K_ROTARY:  /* q and k rotated (the cache write is the publish's) */
        memcpy(t->row_a, b->qkv + i * d->qkv_size, sizeof(float) * (d->q_size + d->kv_size));
        rotary_token(t->row_a, s->heads + s->kv_heads, s->head_dim, d->model.cos_sin + b->positions[i] * s->head_dim);
        break;
    case K_ATTN: {
        int64_t r, g, heads;
        attention_item(d, p, i, &r, &g, &heads);
        attend(b->qkv + r * d->qkv_size, s->head_dim, l->k_cache, l->v_cache, (int)s->kv_bf16, b->tables + r * b->w_cap,
               b->lens[r],
               g, g + heads, d->group, s->head_dim, s->block_size, d->kv_size, s->scale, t->scores, t->acc, t->row_a);
        break;
    }
    case K_SILU:
        silu_mul_row(b->gate_up + i * 2 * s->intermediate, t->row_a, s->intermediate);
        break;
    case K_ARGMAX: {  /* over the LM-head items' winners in column order: argmax_row's rule */
        const int64_t items = matmul_items(d, s->vocab, s->hidden);
        int64_t best = -1;
        float best_value = 0.0f;
        for (int64_t j = 0; j < items; ++j) {
            const float v = b->best_value[j * b->m_cap + i];
            if (v != v) {
                best = b->best_index[j * b->m_cap + i];
                break;
            }
            if (best < 0 || v > best_value) {
                best = b->best_index[j * b->m_cap + i];
                best_value = v;
            }
        }
        w->argmax = best;
        break;
    }
    default: {  /* panels [p0, p1) of a matmul, every row */
        const matmul mm = matmul_of(d, p, f->kind, f->layer);
        const int64_t per = panels_per_item(d, mm.k), ld = per * PANEL, panels = (mm.n + PANEL - 1) / PANEL;
        const int64_t p0 = i * per, p1 = p0 + per < panels ? p0 + per : panels, m = p->m;
        panels_product_any(mm.x, m, m, mm.k, mm.w, (int)s->weight_bf16, p0, p1, mm.n, mm.bias, t->tile, ld);
        if (f->kind == K_LM_HEAD && p->greedy != NULL) {
            const int64_t c0 = p0 * PANEL, cols = (p1 * PANEL < mm.n ? p1 * PANEL : mm.n) - c0;
            for (int64_t r = 0; r < m; ++r) {
                const int64_t j = argmax_row(t->tile + r * ld, cols);
                t->best_index[r] = c0 + j;
                t->best_value[r] = t->tile[r * ld + j];
            }
        }
    }
    }
}

static void publish_item(const pdserve_decoder *d, worker *w, const step_params *p, const phase *f, int64_t i) {
    const pdserve_decoder_shape *s = &d->s;
    const buffers *b = p->buf;
    const thread_buffers *t = &b->threads[w->index];
    const pdserve_decoder_layer *l = &d->layers[f->layer < d->model.num_layers ? f->layer : 0];
    switch (f->kind) {
    case K_NORM_IN:
    case K_NORM_POST:
    case K_NORM_FINAL:
        memcpy(b->h + i * s->hidden, t->row_a, sizeof(float) * s->hidden);
        memcpy(b->x + i * s->hidden, t->row_b, sizeof(float) * s->hidden);
        break;
    case K_ROTARY: {
        float *row_qkv = b->qkv + i * d->qkv_size;
        memcpy(row_qkv, t->row_a, sizeof(float) * (d->q_size + d->kv_size));
        const int64_t at = b->slots[i] * d->kv_size * (s->kv_bf16 ? 2 : 4);
        kv_store((char *)l->k_cache + at, row_qkv + d->q_size, d->kv_size, (int)s->kv_bf16);
        kv_store((char *)l->v_cache + at, row_qkv + d->q_size + d->kv_size, d->kv_size, (int)s->kv_bf16);
        break;
    }
    case K_ATTN: {
        int64_t r, g, heads;
        attention_item(d, p, i, &r, &g, &heads);
        memcpy(b->attn + r * d->q_size + g * d->group * s->head_dim, t->row_a, sizeof(float) * heads * d->group * s->head_dim);
        break;
    }
    case K_SILU:
        memcpy(b->act + i * s->intermediate, t->row_a, sizeof(float) * s->intermediate);
        break;
    case K_ARGMAX:
        p->greedy[i] = w->argmax;
        break;
    default: {
        const matmul mm = matmul_of(d, p, f->kind, f->layer);
        const int64_t per = panels_per_item(d, mm.k), ld = per * PANEL, c0 = i * per * PANEL;
        const int64_t cols = (c0 + ld < mm.n ? c0 + ld : mm.n) - c0;
        for (int64_t r = 0; r < p->m; ++r) memcpy(mm.out + r * mm.n + c0, t->tile + r * ld, sizeof(float) * cols);
        if (f->kind == K_LM_HEAD && p->greedy != NULL)
            for (int64_t r = 0; r < p->m; ++r) {
                b->best_index[i * b->m_cap + r] = t->best_index[r];
                b->best_value[i * b->m_cap + r] = t->best_value[r];
            }
    }
    }
}

static uint64_t next_random(uint64_t *x) { /* xorshift64 */
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* Tests only (pdserve_decoder_chaos): sleep now and then, as a descheduled thread would. */
static void maybe_stall(pdserve_decoder *d, worker *w) {
    const int permille = atomic_load_explicit(&d->chaos_permille, memory_order_relaxed);
    if (permille > 0 && (int)(next_random(&w->rng) % 1000) < permille) {
        const int64_t us = (int64_t)(next_random(&w->rng) % (uint64_t)(atomic_load(&d->chaos_max_us) + 1));
        struct timespec t = {us / 1000000, (us % 1000000) * 1000};
        nanosleep(&t, NULL);
    }
}

/* Compute item i (which `claimer` claimed) and publish it unless another thread did first. */
static void run_item(pdserve_decoder *d, worker *w, const step_params *p, const phase *f, int64_t i,
                     _Atomic uint64_t *state, int claimer) {
    compute_item(d, w, p, f, i);
    maybe_stall(d, w);
    uint64_t expect = state_word(p->tag, ST_CLAIMED, claimer);
    if (!atomic_compare_exchange_strong_explicit(state, &expect, state_word(p->tag, ST_STORING, w->index),
                                                 memory_order_acq_rel, memory_order_relaxed)) {
        stat_add(d, STAT_DROPPED);
        return;
    }
    publish_item(d, w, p, f, i);
    atomic_store_explicit(state, state_word(p->tag, ST_DONE, w->index), memory_order_release);
}

static int claim(_Atomic uint64_t *state, uint64_t tag, int who) {
    uint64_t expect = state_word(tag, ST_FREE, 0);
    return atomic_compare_exchange_strong_explicit(state, &expect, state_word(tag, ST_CLAIMED, who),
                                                   memory_order_acq_rel, memory_order_relaxed);
}

/* Wait until every item of the phase is published (acquire: its outputs are then visible), taking
 * free items and redoing those claimed by a thread that has sat on them too long. 0 when a newer
 * step has begun (this thread is late: its step is over). */
static int await_phase(pdserve_decoder *d, worker *w, const step_params *p, const phase *f,
                       _Atomic uint64_t *states) {
    const uint64_t tag = p->tag;
    int64_t redo_after = 4 * w->item_ns[f->kind], waiting_since = 0;
    if (redo_after < REDO_MIN_NS) redo_after = REDO_MIN_NS;
    for (int64_t i = 0, spins = 0;; ++spins) {
        uint64_t cur = 0;
        while (i < f->n && state_of(cur = atomic_load_explicit(&states[i], memory_order_acquire)) == ST_DONE &&
               tagged(cur, tag))
            ++i;
        if (i == f->n) return 1;
        if (atomic_load_explicit(&d->p_tag, memory_order_relaxed) != tag) return 0;
        if (state_of(cur) == ST_FREE) {
            if (claim(&states[i], tag, w->index)) run_item(d, w, p, f, i, &states[i], w->index);
            continue;
        }
        if (state_of(cur) == ST_CLAIMED && spins % 16 == 0) {
            const int64_t now = now_ns();
            if (waiting_since == 0) {
                waiting_since = now;
            } else if (now - waiting_since > redo_after) {
                for (int64_t j = i; j < f->n; ++j) {
                    const uint64_t c = atomic_load_explicit(&states[j], memory_order_relaxed);
                    if (!tagged(c, tag)) break;
                    if (state_of(c) == ST_CLAIMED && who_of(c) != w->index) {
                        stat_add(d, STAT_REDONE);
                        run_item(d, w, p, f, j, &states[j], who_of(c));
                    } else if (state_of(c) == ST_FREE && claim(&states[j], tag, w->index)) {
                        run_item(d, w, p, f, j, &states[j], w->index);
                    }
                }
                waiting_since = 0;
                continue;
            }
        }
        CPU_RELAX();
    }
}

/* Thread w's part of one phase: its share from the front, then the others' from their ends. */
static int run_phase(pdserve_decoder *d, worker *w, const step_params *p, const phase *f) {
    _Atomic uint64_t *states = p->buf->states + f->offset;
    const uint64_t tag = p->tag;
    const int t = w->index, nt = (int)p->nt;
    const int64_t start = now_ns();
    int64_t done = 0;
    for (int64_t i = f->n * t / nt; i < f->n * (t + 1) / nt && claim(&states[i], tag, t); ++i, ++done)
        run_item(d, w, p, f, i, &states[i], t);
    for (int v = 1; v < nt; ++v) {
        const int u = (t + v) % nt;
        for (int64_t i = f->n * (u + 1) / nt - 1; i >= f->n * u / nt; --i) {
            const uint64_t cur = atomic_load_explicit(&states[i], memory_order_relaxed);
            if (state_of(cur) == ST_FREE && tagged(cur, tag)) {
                if (claim(&states[i], tag, t)) {
                    stat_add(d, STAT_STOLEN);
                    run_item(d, w, p, f, i, &states[i], t);
                    ++done;
                }
            } else if (!tagged(cur, tag) || who_of(cur) == u) {
                break;  /* its owner got this far (or the step is over) */
            }
        }
    }
    if (done > 0) w->item_ns[f->kind] = (now_ns() - start) / done;
    return await_phase(d, w, p, f, states);
}

/* Every phase of the step, as thread w; returns early when the step is over without it. */
static void run_step(pdserve_decoder *d, worker *w, const step_params *p) {
    int64_t counts[K_KINDS], offset = 0;
    count_items(d, p->m, p->greedy != NULL, attention_heads_per_item(p->m, p->nt, d->s.kv_heads), counts);
    const int64_t layer_phases = d->model.num_layers * K_LAYER_KINDS;
    for (int64_t ph = 0; ph < layer_phases + 3; ++ph) {
        phase f;
        f.kind = ph < layer_phases ? (int)(ph % K_LAYER_KINDS) : K_LAYER_KINDS + (int)(ph - layer_phases);
        f.layer = ph < layer_phases ? ph / K_LAYER_KINDS : d->model.num_layers;
        f.n = counts[f.kind];
        f.offset = offset;
        offset += f.n;
        if (f.n > 0 && !run_phase(d, w, p, &f)) return;
    }
}

/* -- Helpers ---------------------------------------------------------------------------------- */
static void futex_wait(_Atomic uint32_t *word, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void read_step(pdserve_decoder *d, step_params *p) {
    for (;;) {
        const uint64_t seq = atomic_load_explicit(&d->pseq, memory_order_acquire);
        if (seq & 1) {
            CPU_RELAX();
            continue;
        }
        p->tag = atomic_load_explicit(&d->p_tag, memory_order_relaxed);
        p->m = atomic_load_explicit(&d->p_m, memory_order_relaxed);
        p->nt = atomic_load_explicit(&d->p_nt, memory_order_relaxed);
        p->buf = atomic_load_explicit(&d->p_buf, memory_order_relaxed);
        p->logits = atomic_load_explicit(&d->p_logits, memory_order_relaxed);
        p->greedy = atomic_load_explicit(&d->p_greedy, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&d->pseq, memory_order_relaxed) == seq) return;
    }
}

static void *helper_main(void *arg) {
    worker *w = arg;
    pdserve_decoder *d = w->dec;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals are the caller's business */
    uint32_t seen = atomic_load(&d->wake);
    for (;;) {
        const int64_t spin_until = now_ns() + SPIN_NS;
        for (int64_t spins = 0; atomic_load_explicit(&d->wake, memory_order_acquire) == seen; ++spins) {
            if (atomic_load_explicit(&d->quit, memory_order_relaxed)) return NULL;
            if (spins % 64 != 63 || now_ns() < spin_until) {
                CPU_RELAX();
                continue;
            }
            atomic_fetch_add(&d->sleepers, 1);
            if (atomic_load(&d->wake) == seen && !atomic_load(&d->quit)) futex_wait(&d->wake, seen);
            atomic_fetch_sub(&d->sleepers, 1);
        }
        if (atomic_load(&d->quit)) return NULL;
        step_params p;
        read_step(d, &p);
        seen = (uint32_t)p.tag;
        if (w->index >= p.nt || p.buf == NULL) continue;
        maybe_stall(d, w);
        run_step(d, w, &p);
    }
}

static worker *new_worker(pdserve_decoder *d, int index) {
    worker *w = NULL;
    if (posix_memalign((void **)&w, 64, sizeof(worker)) == 0) {
        memset(w, 0, sizeof(worker));
        w->dec = d;
        w->index = index;
        w->rng = 0x9e3779b97f4a7c15ull * (uint64_t)(index + 1);
    }
    return w;
}

/* Start helpers until nt threads can work (fewer if the system refuses); how many can. */
static int ensure_threads(pdserve_decoder *d, int nt) {
    while (d->num_workers < nt) {
        worker *w = new_worker(d, d->num_workers);
        if (w == NULL) break;
        if (pthread_create(&w->thread, NULL, helper_main, w) != 0) {
            free(w);
            break;
        }
        pthread_setname_np(w->thread, "pdserve-step");
        d->workers[d->num_workers++] = w;
    }
    return d->num_workers < nt ? d->num_workers : nt;
}

/* -- Buffers ---------------------------------------------------------------------------------- */
/* Lay b's arrays out in one block at `base` (NULL: only measure); returns the block's bytes. */
static int64_t lay_out(const pdserve_decoder *d, buffers *b, char *base) {
    const pdserve_decoder_shape *s = &d->s;
    const int64_t m = b->m_cap, lm_items = matmul_items(d, s->vocab, s->hidden);
    int64_t tile_cols = 0, row = s->hidden, used = 0;
    const int64_t ks[] = {s->hidden, d->q_size, s->intermediate};
    for (int j = 0; j < 3; ++j)
        if (panels_per_item(d, ks[j]) * PANEL > tile_cols) tile_cols = panels_per_item(d, ks[j]) * PANEL;
    if (d->qkv_size > row) row = d->qkv_size;
    if (s->intermediate > row) row = s->intermediate;
#define CARVE(bytes) (used += ((bytes) + 63) & ~(int64_t)63, base != NULL ? (void *)(base + used - (((bytes) + 63) & ~(int64_t)63)) : NULL)
    b->ids = CARVE(8 * m);
    b->positions = CARVE(8 * m);
    b->slots = CARVE(8 * m);
    b->lens = CARVE(8 * m);
    b->tables = CARVE(8 * m * b->w_cap);
    b->h = CARVE(4 * m * s->hidden);
    b->x = CARVE(4 * m * s->hidden);
    b->qkv = CARVE(4 * m * d->qkv_size);
    b->attn = CARVE(4 * m * d->q_size);
    b->o_out = CARVE(4 * m * s->hidden);
    b->gate_up = CARVE(4 * m * 2 * s->intermediate);
    b->act = CARVE(4 * m * s->intermediate);
    b->down_out = CARVE(4 * m * s->hidden);
    b->best_index = CARVE(8 * lm_items * m);
    b->best_value = CARVE(4 * lm_items * m);
    b->states = CARVE(8 * total_items(d, m));
    b->threads = CARVE((int64_t)sizeof(thread_buffers) * b->nt_cap);
    for (int64_t t = 0; t < b->nt_cap; ++t) {
        thread_buffers tb;
        tb.tile = CARVE(4 * m * tile_cols);
        tb.row_a = CARVE(4 * row);
        tb.row_b = CARVE(4 * s->hidden);
        tb.scores = CARVE(4 * s->heads * b->w_cap * s->block_size);
        tb.acc = CARVE(4 * s->heads * s->head_dim);
        tb.best_index = CARVE(8 * m);
        tb.best_value = CARVE(4 * m);
        if (base != NULL) b->threads[t] = tb;
    }
#undef CARVE
    return used;
}

/* Buffers for m rows, block tables `width` wide and nt threads: the current ones, or bigger ones
 * (the old ones retired, not freed: a late thread may still read them). NULL when out of memory. */
static buffers *ensure_buffers(pdserve_decoder *d, int64_t m, int64_t width, int64_t nt) {
    buffers *old = d->buf;
    if (old != NULL && m <= old->m_cap && width <= old->w_cap && nt <= old->nt_cap) return old;
    buffers *b = calloc(1, sizeof(buffers));
    if (b == NULL) return NULL;
    b->m_cap = old != NULL ? old->m_cap : 8;
    b->w_cap = old != NULL ? old->w_cap : 16;
    b->nt_cap = old != NULL && old->nt_cap > nt ? old->nt_cap : nt;
    while (b->m_cap < m) b->m_cap *= 2;
    while (b->w_cap < width) b->w_cap *= 2;
    const int64_t bytes = lay_out(d, b, NULL);
    /* Zeroed: ids, positions, slots and tables hold valid indices for a late reader from the start. */
    if (posix_memalign(&b->memory, 64, (size_t)bytes) != 0) {
        free(b);
        return NULL;
    }
    memset(b->memory, 0, (size_t)bytes);
    lay_out(d, b, b->memory);
    b->retired = old;
    d->buf = b;
    return b;
}

/* -- The API ---------------------------------------------------------------------------------- */
/* item_bytes: a matmul item's weights (items are whole panels: at least one). */
pdserve_decoder *pdserve_decoder_new(const pdserve_decoder_model *model, const pdserve_decoder_shape *s,
                                     int64_t item_bytes) {
    pdserve_decoder *d = calloc(1, sizeof(pdserve_decoder));
    if (d == NULL) return NULL;
    d->layers = malloc(sizeof(pdserve_decoder_layer) * (model->num_layers > 0 ? model->num_layers : 1));
    d->workers[0] = new_worker(d, 0);
    if (d->layers == NULL || d->workers[0] == NULL) {
        free(d->layers);
        free(d->workers[0]);
        free(d);
        return NULL;
    }
    memcpy(d->layers, model->layers, sizeof(pdserve_decoder_layer) * model->num_layers);
    d->model = *model;
    d->model.layers = d->layers;
    d->s = *s;
    d->q_size = s->heads * s->head_dim;
    d->kv_size = s->kv_heads * s->head_dim;
    d->qkv_size = d->q_size + 2 * d->kv_size;
    d->group = s->heads / s->kv_heads;
    d->item_bytes = item_bytes;
    d->num_workers = 1;
    return d;
}

/* Stop and join the helpers (a late one first finishes its item), then free everything. */
void pdserve_decoder_free(pdserve_decoder *d) {
    if (d == NULL) return;
    atomic_store(&d->quit, 1);
    atomic_fetch_add(&d->wake, 1);
    futex_wake(&d->wake);
    for (int i = 1; i < d->num_workers; ++i) pthread_join(d->workers[i]->thread, NULL);
    for (int i = 0; i < d->num_workers; ++i) free(d->workers[i]);
    for (buffers *b = d->buf; b != NULL;) {
        buffers *next = b->retired;
        free(b->memory);
        free(b);
        b = next;
    }
    free(d->layers);
    free(d);
}

/* One decode step. ints: m token ids, then m positions, m cache slots, m sequence lengths, then m
 * block tables `width` wide (int64); logits [m, vocab] out; greedy: NULL, or [m] out for each
 * row's argmax (argmax_row's rule). Writes the tokens' K and V into the cache. Returns 0; 1 when
 * buffers could not be allocated; 2 when an index is out of range (nothing was computed). */
int pdserve_decoder_step(pdserve_decoder *d, const int64_t *ints, int64_t m, int64_t width, float *logits,
                         int64_t *greedy, int num_threads) {
    const pdserve_decoder_shape *s = &d->s;
    if (m <= 0 || width <= 0) return m == 0 ? 0 : 2;
    const int64_t *ids = ints, *positions = ints + m, *slots = ints + 2 * m, *lens = ints + 3 * m,
                  *tables = ints + 4 * m;
    for (int64_t r = 0; r < m; ++r) {
        if (ids[r] < 0 || ids[r] >= s->vocab || positions[r] < 0 || positions[r] >= s->max_position ||
            slots[r] < 0 || slots[r] >= s->num_blocks * s->block_size || lens[r] < 1 || lens[r] > width * s->block_size)
            return 2;
        for (int64_t j = 0; j < width; ++j)
            if (tables[r * width + j] < 0 || tables[r * width + j] >= s->num_blocks) return 2;
    }
    const int nt = ensure_threads(d, num_threads < 1 ? 1 : num_threads > MAX_THREADS ? MAX_THREADS : num_threads);
    buffers *b = ensure_buffers(d, m, width, nt);
    if (b == NULL) return 1;
    memcpy(b->ids, ids, 8 * m);
    memcpy(b->positions, positions, 8 * m);
    memcpy(b->slots, slots, 8 * m);
    memcpy(b->lens, lens, 8 * m);
    for (int64_t r = 0; r < m; ++r) {
        memcpy(b->tables + r * b->w_cap, tables + r * width, 8 * width);
        memcpy(b->h + r * s->hidden, d->model.embedding + ids[r] * s->hidden, sizeof(float) * s->hidden);
    }
    const uint64_t tag = ++d->last_tag;
    const int64_t n = total_items(d, m);
    for (int64_t i = 0; i < n; ++i) atomic_store_explicit(&b->states[i], state_word(tag, ST_FREE, 0), memory_order_relaxed);
    /* Publish the step (seqlock), then wake the helpers that sleep. */
    const uint64_t seq = atomic_load_explicit(&d->pseq, memory_order_relaxed);
    atomic_store_explicit(&d->pseq, seq + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&d->p_tag, tag, memory_order_relaxed);
    atomic_store_explicit(&d->p_m, m, memory_order_relaxed);
    atomic_store_explicit(&d->p_nt, nt, memory_order_relaxed);
    atomic_store_explicit(&d->p_buf, b, memory_order_relaxed);
    atomic_store_explicit(&d->p_logits, logits, memory_order_relaxed);
    atomic_store_explicit(&d->p_greedy, greedy, memory_order_relaxed);
    atomic_store_explicit(&d->pseq, seq + 2, memory_order_release);
    if (nt > 1) {
        atomic_store(&d->wake, (uint32_t)tag);
        if (atomic_load(&d->sleepers) > 0) futex_wake(&d->wake);
    }
    const step_params p = {tag, m, nt, b, logits, greedy};
    run_step(d, d->workers[0], &p);
    stat_add(d, STAT_STEPS);
    return 0;
}

/* Counters since the decoder was made: steps, items taken from another thread's share, items
 * redone because their thread sat on them, results dropped because another thread published first. */
void pdserve_decoder_stats(pdserve_decoder *d, int64_t out[4]) {
    for (int i = 0; i < 4; ++i) out[i] = atomic_load(&d->stats[i]);
}

/* Tests: every thread sleeps up to max_us before a permille of its publishes and of its steps. */
void pdserve_decoder_chaos(pdserve_decoder *d, int permille, int max_us) {
    atomic_store(&d->chaos_max_us, max_us);
    atomic_store(&d->chaos_permille, permille);
}


/* The first index of v's largest value, or of its first NaN if it has one (torch's argmax): one
 * vector pass for the maximum (and whether any value is NaN), then one for where it first occurs. */
static int64_t argmax_row(const float *v, int64_t n) {
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
