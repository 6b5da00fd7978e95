/* pdserve's fp32 CPU kernels, in this order: paged decode attention; the decoder layer's elementwise
 * work (RMSNorm with the residual add, silu * up, rotary); the linear layers' matmul over weights
 * packed in column panels; a whole decode step in one call, token ids to logits; greedy argmax.
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
 *   block_tables [batch, table_width] int64, dense
 *   seq_lens     [batch] int64
 *   out          [batch, num_heads, head_dim]       dense
 *
 * Built by cpu_kernels.py with the system C compiler (-O3 -march=native -fopenmp); loaded after
 * torch, so `libgomp.so.1` resolves to the OpenMP runtime torch already runs (one thread pool).
 * AVX2/FMA code paths where the CPU has them, plain C (vectorised by the compiler) elsewhere.
 */

#define _DEFAULT_SOURCE /* madvise */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

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

/* Ask for the cache lines of `bytes` bytes at p ahead of use: a sequence's blocks are scattered
 * over the cache, so the hardware prefetcher loses the stream at every block boundary. */
static inline void prefetch(const float *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

/* Rows of one KV head for tokens [t, t + n) of a sequence: row(i) = base of token t + i. */
static inline const float *row(const float *cache, const int64_t *table, int64_t t, int64_t block_size,
                               int64_t block_stride, int64_t token_stride, int64_t head_offset) {
    return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + head_offset;
}

/* One sequence's KV heads [h0, h1) against its `len` tokens; each KV head serves `group` query
 * heads (q row h * group + g, stride q_head_stride; out rows likewise, dense). Rows of all the
 * heads of a token are adjacent in the cache, so reading them together streams whole blocks.
 * scores: scratch of (h1 - h0) * group * len floats; acc: (h1 - h0) * group * head_dim floats. */
static void attend(const float *q, int64_t q_head_stride, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t len, int64_t h0, int64_t h1, int64_t group, int64_t head_dim,
                   int64_t block_size, int64_t token_stride, float scale, float *scores, float *acc,
                   float *out) {
    const int64_t block_stride = block_size * token_stride;
    const int64_t rows = (h1 - h0) * group;

    /* Pass 1: scores, reading each K row once for all the query heads it serves. */
    int64_t t = 0;
#ifdef HAVE_AVX2
    if (head_dim % 8 == 0) {
        for (; t + 8 <= len; t += 8) {  /* eight tokens at a time: eight independent FMA chains */
            const float *k[8];
            for (int j = 0; j < 8; ++j) k[j] = row(k_cache, table, t + j, block_size, block_stride, token_stride, 0);
            for (int64_t j = t + 16; j < t + 24 && j < len; ++j)  /* two steps ahead */
                prefetch(row(k_cache, table, j, block_size, block_stride, token_stride, 0) + h0 * head_dim,
                         (h1 - h0) * head_dim * 4);
            for (int64_t h = h0; h < h1; ++h) {
                const int64_t o = h * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    const float *qg = q + (h * group + g) * q_head_stride;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                    for (int64_t d = 0; d < head_dim; d += 8) {
                        __m256 qv = _mm256_loadu_ps(qg + d);
                        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + o + d), a0);
                        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + o + d), a1);
                        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + o + d), a2);
                        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + o + d), a3);
                        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + o + d), a4);
                        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + o + d), a5);
                        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + o + d), a6);
                        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + o + d), a7);
                    }
                    _mm256_storeu_ps(scores + ((h - h0) * group + g) * len + t,
                                     _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
                }
            }
        }
    }
#endif
    for (; t < len; ++t) {
        const float *k = row(k_cache, table, t, block_size, block_stride, token_stride, 0);
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t g = 0; g < group; ++g)
                scores[((h - h0) * group + g) * len + t] =
                    dot(q + (h * group + g) * q_head_stride, k + h * head_dim, head_dim) * scale;
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
        const float *vb = v_cache + table[blk] * block_stride;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        if (t0 + block_size < len)  /* the next block, one block ahead */
            for (int64_t i = 0; i < block_size && t0 + block_size + i < len; ++i)
                prefetch(v_cache + table[blk + 1] * block_stride + i * token_stride + h0 * head_dim,
                         (h1 - h0) * head_dim * 4);
        for (int64_t r = 0; r < rows; ++r) {
            float *ar = acc + r * head_dim;
            const float *p = scores + r * len + t0;
            const float *vh = vb + (h0 + r / group) * head_dim;
            int64_t d = 0;
#ifdef HAVE_AVX2
            for (; d + 32 <= head_dim; d += 32) {  /* four accumulators held across the block's tokens */
                __m256 a0 = _mm256_loadu_ps(ar + d), a1 = _mm256_loadu_ps(ar + d + 8);
                __m256 a2 = _mm256_loadu_ps(ar + d + 16), a3 = _mm256_loadu_ps(ar + d + 24);
                for (int64_t i = 0; i < n; ++i) {
                    const float *v = vh + i * token_stride + d;
                    __m256 pv = _mm256_set1_ps(p[i]);
                    a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v), a0);
                    a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8), a1);
                    a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 16), a2);
                    a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 24), a3);
                }
                _mm256_storeu_ps(ar + d, a0);
                _mm256_storeu_ps(ar + d + 8, a1);
                _mm256_storeu_ps(ar + d + 16, a2);
                _mm256_storeu_ps(ar + d + 24, a3);
            }
#endif
            if (d < head_dim)
                for (int64_t i = 0; i < n; ++i) axpy(ar + d, p[i], vh + i * token_stride + d, head_dim - d);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *o = out + (h0 * group + r) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[r * head_dim + d] * inv_sum[r];
    }
}

/* Per-thread scratch that outlives the call (OpenMP's threads persist): long contexts need
 * megabytes of scores, and a fresh allocation that size would be page-faulted in on every call.
 * NULL when it cannot grow. */
static float *scratch(int which, int64_t floats) {
    static __thread float *buf[2];
    static __thread int64_t cap[2];
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
static int attention_part(const float *q, int64_t q_batch_stride, int64_t q_head_stride, const float *k_cache,
                          const float *v_cache, const int64_t *block_tables, int64_t table_width,
                          const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; ++b) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Work items: whole sequences (all their heads: whole blocks stream in) when there are enough
     * to keep every thread busy, else (sequence, KV head) pairs. */
    const int64_t heads_per_item = batch >= 4 * omp_get_num_threads() ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / heads_per_item;
    const int64_t rows = heads_per_item * group;
    float *scores = scratch(0, rows * (max_len > 0 ? max_len : 1));
    float *acc = scratch(1, rows * head_dim);
    /* Every thread takes part in the loop (a worksharing construct must be met by all). */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * items_per_seq; ++item) {
        const int64_t b = item / items_per_seq, h0 = (item % items_per_seq) * heads_per_item;
        if (scores == NULL || acc == NULL || seq_lens[b] <= 0) continue;
        attend(q + b * q_batch_stride, q_head_stride, k_cache, v_cache, block_tables + b * table_width, seq_lens[b],
               h0, h0 + heads_per_item, group, head_dim, block_size, token_stride, scale, scores, acc,
               out + b * num_heads * head_dim);
    }
    return scores == NULL || acc == NULL;
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int pdserve_paged_decode_attention_f32(const float *q, int64_t q_batch_stride, int64_t q_head_stride,
                                       const float *k_cache, const float *v_cache, const int64_t *block_tables,
                                       int64_t table_width, const int64_t *seq_lens, float *out, int64_t batch,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    failed = attention_part(q, q_batch_stride, q_head_stride, k_cache, v_cache, block_tables, table_width, seq_lens,
                            out, batch, num_heads, num_kv_heads, head_dim, block_size, scale);
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
 * - several rows use a 6 x 16 register tile: per k, two weight vectors and six broadcasts of x
 *   feed twelve FMAs, so from about sixteen rows on the loop runs at the cores' FMA rate, not the
 *   memory's; a panel (16 x K floats) stays in cache while every row block passes over it.
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

void pdserve_pack_linear_f32(const float *w, int64_t n, int64_t k, float *packed, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    pdserve_want_huge_pages(packed, sizeof(float) * panels * PANEL * k);
#pragma omp parallel for num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * k * PANEL;
        for (int64_t j = 0; j < PANEL; ++j) {
            const int64_t col = p * PANEL + j;
            for (int64_t i = 0; i < k; ++i) dst[i * PANEL + j] = col < n ? w[col * k + i] : 0.0f;
        }
    }
}

/* Write the first `cols` columns of a 16-column result row (+ bias). */
static inline void store_row(float *out, const float *vals, int64_t cols, const float *bias) {
    for (int64_t j = 0; j < cols; ++j) out[j] = vals[j] + (bias != NULL ? bias[j] : 0.0f);
}

#ifdef HAVE_AVX2
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
        const float *x, int64_t ldx, const float *panel, int64_t k, float *out, int64_t ldo,         \
        int64_t cols, const float *bias) {                                                           \
        /* Every loop over r is unrolled, so the accumulators live in registers (a loop left     \
         * rolled makes GCC keep them in memory and store them on every k: half the speed). */  \
        __m256 lo[MR], hi[MR];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {                                      \
            lo[r] = _mm256_setzero_ps();                                                             \
            hi[r] = _mm256_setzero_ps();                                                             \
        }                                                                                            \
        for (int64_t i = 0; i < k; ++i) {                                                            \
            const __m256 w0 = _mm256_loadu_ps(panel + i * PANEL), w1 = _mm256_loadu_ps(panel + i * PANEL + 8); \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {                                  \
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);                              \
                lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);                                              \
                hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);                                              \
            }                                                                                        \
        }                                                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) store_16(out + r * ldo, lo[r], hi[r], cols, bias); \
    }
LINEAR_TILE(6)
LINEAR_TILE(4)
LINEAR_TILE(2)
LINEAR_TILE(1)

/* One row of x: two k at a time, four independent FMA chains (memory-bound: keep loads in flight). */
static void linear_row(const float *x, const float *panel, int64_t k, float *out, int64_t cols,
                       const float *bias) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t i = 0;
    for (; i + 2 <= k; i += 2) {
        const __m256 x0 = _mm256_broadcast_ss(x + i), x1 = _mm256_broadcast_ss(x + i + 1);
        const float *w = panel + i * PANEL;
        a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w), a0);
        a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + 8), a1);
        b0 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + 16), b0);
        b1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + 24), b1);
    }
    if (i < k) {
        const __m256 x0 = _mm256_broadcast_ss(x + i);
        a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + i * PANEL), a0);
        a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + i * PANEL + 8), a1);
    }
    store_16(out, _mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), cols, bias);
}
#endif

/* Plain C for CPUs without AVX2/FMA (the compiler vectorises the inner loop). */
static void linear_rows_portable(const float *x, int64_t rows, int64_t k, const float *panel, float *out,
                                 int64_t ldo, int64_t cols, const float *bias) {
    for (int64_t r = 0; r < rows; ++r) {
        float vals[PANEL] = {0};
        for (int64_t i = 0; i < k; ++i) {
            const float xv = x[r * k + i];
#pragma omp simd
            for (int j = 0; j < PANEL; ++j) vals[j] += xv * panel[i * PANEL + j];
        }
        store_row(out + r * ldo, vals, cols, bias);
    }
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

/* Thread t of nt's part of out [m, n] = x [m, k] (dense) @ W^T (+ bias [n]): its share of the panels. */
static void linear_part(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                        float *out, int t, int nt) {
    /* Rows per block: x's block (block * k floats) takes half of a 512 KiB L2; a multiple of 6. */
    int64_t block = (64 * 1024) / (k > 0 ? k : 1);
    block = block < 6 ? 6 : block - block % 6;
    int64_t p0, p1;
    part_panels(m, k, n, t, nt, &p0, &p1);
    for (int64_t m0 = 0; m0 < m; m0 += block) {
        const int64_t m1 = m0 + block < m ? m0 + block : m;
        for (int64_t p = p0; p < p1; ++p) {
            const float *panel = packed + p * k * PANEL;
            const int64_t c = p * PANEL, cols = n - c < PANEL ? n - c : PANEL;
            const float *b = bias != NULL ? bias + c : NULL;
            int64_t r = m0;
#ifdef HAVE_AVX2
            if (m == 1) {
                linear_row(x, panel, k, out + c, cols, b);
                continue;
            }
            for (; r + 6 <= m1; r += 6) linear_tile_6(x + r * k, k, panel, k, out + r * n + c, n, cols, b);
            for (; r + 4 <= m1; r += 4) linear_tile_4(x + r * k, k, panel, k, out + r * n + c, n, cols, b);
            for (; r + 2 <= m1; r += 2) linear_tile_2(x + r * k, k, panel, k, out + r * n + c, n, cols, b);
            for (; r < m1; ++r) linear_tile_1(x + r * k, k, panel, k, out + r * n + c, n, cols, b);
#endif
            linear_rows_portable(x + r * k, m1 - r, k, panel, out + r * n + c, n, cols, b);
        }
    }
}

/* out [m, n] = x [m, k] (dense) @ W^T (+ bias [n]), W packed by pdserve_pack_linear_f32. */
void pdserve_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                        float *out, int num_threads) {
    if (m * n * k < (1 << 16)) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    linear_part(x, m, k, packed, n, bias, out, omp_get_thread_num(), omp_get_num_threads());
}

/* -- A whole decode step in one call ---------------------------------------------------------------
 * Called one by one from Python, a layer's eleven kernels pay for module calls, views, checks and
 * ctypes between them: ~3 ms of a ~12 ms batch-1 step on the benchmark model; the embedding lookup,
 * rotary rows, final norm and LM head around the layers another ~0.2 ms. For a dense Llama-family
 * model in fp32 with every linear packed for pdserve_linear_f32, a decode-only step (one new token
 * per sequence, every row sampled) runs here from token ids to logits:
 *   h = embedding[id]; per layer:
 *     x = norm(h); qkv = x Wqkv (+b); rotary(q, k); cache[slot] = k, v; a = attention(q);
 *     h += a Wo; x = norm(h); h += (silu(x Wg) * x Wu) Wd
 *   logits = norm(h) Wlm
 * with the same row and part functions as the kernels the Python path calls, so both paths compute
 * the same values. */

typedef struct {
    const float *input_norm, *post_norm;                  /* [hidden] */
    const float *qkv, *qkv_bias, *o, *gate_up, *down;     /* packed (pdserve_pack_linear_f32); bias may be NULL */
    float *k_cache, *v_cache;                             /* [num_blocks, block_size, kv_heads, head_dim], dense */
} pdserve_decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, vocab;
    float eps, scale;
} pdserve_decoder_shape;

typedef struct {
    const pdserve_decoder_layer *layers;
    int64_t num_layers;
    const float *embedding;   /* [vocab rows, hidden], dense */
    const float *cos_sin;     /* [max_position, 2, head_dim / 2]: the rotary table */
    const float *final_norm;  /* [hidden] */
    const float *lm_head;     /* packed, `vocab` output columns */
} pdserve_decoder_model;

static int64_t gate_up_floats(const pdserve_decoder_shape *s) {  /* also holds the o projection's output */
    return 2 * s->intermediate > s->hidden ? 2 * s->intermediate : s->hidden;
}

/* Scratch floats pdserve_decode_step_f32 needs for m sequences. */
int64_t pdserve_decode_work_floats(const pdserve_decoder_shape *s, int64_t m) {
    const int64_t qkv = (s->heads + 2 * s->kv_heads) * s->head_dim;
    return m * (2 * s->hidden + s->head_dim + qkv + s->heads * s->head_dim + gate_up_floats(s) + s->intermediate);
}

static int64_t argmax_row(const float *v, int64_t n);

/* ids, positions, slots, seq_lens [m]; block_tables [m, table_width] (int64, dense); work: scratch of
 * pdserve_decode_work_floats(shape, m) floats; logits [m, vocab]; greedy: NULL, or [m] for each row's
 * argmax (as pdserve_argmax_f32). Returns 0, or 1 when scratch memory could not be allocated.
 *
 * One parallel region for the whole step: its ~45 kernels would each wake the team and wait for
 * it again; here they are parts of one team's work with a barrier between (a worksharing loop's
 * end is one). Small work (a row's norm, a token's rotary and cache write) goes to one thread. */
int pdserve_decode_step_f32(const pdserve_decoder_model *model, const pdserve_decoder_shape *s, const int64_t *ids,
                            const int64_t *positions, int64_t m, const int64_t *slots, const int64_t *block_tables,
                            int64_t table_width, const int64_t *seq_lens, float *work, float *logits,
                            int64_t *greedy, int num_threads) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, hidden = s->hidden, inter = s->intermediate;
    float *h = work, *cos_sin = h + m * hidden, *x = cos_sin + m * s->head_dim, *qkv = x + m * hidden;
    float *attn = qkv + m * qkv_size, *gate_up = attn + m * q_size, *act = gate_up + m * gate_up_floats(s);
    /* Greedy: each thread's argmax over the logits it wrote, per row (-1: it wrote none). */
    int64_t *part_best = greedy != NULL ? malloc(sizeof(int64_t) * m * num_threads) : NULL;
    if (greedy != NULL && part_best == NULL) return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp for
        for (int64_t r = 0; r < m; ++r) {
            memcpy(h + r * hidden, model->embedding + ids[r] * hidden, sizeof(float) * hidden);
            memcpy(cos_sin + r * s->head_dim, model->cos_sin + positions[r] * s->head_dim, sizeof(float) * s->head_dim);
        }
        for (int64_t i = 0; i < model->num_layers; ++i) {
            const pdserve_decoder_layer *l = &model->layers[i];
            /* x = norm(h), after h += the previous layer's MLP output (in x). */
#pragma omp for
            for (int64_t r = 0; r < m; ++r)
                rms_norm_row(h + r * hidden, i ? x + r * hidden : NULL, l->input_norm, x + r * hidden, hidden, s->eps);
            linear_part(x, m, hidden, l->qkv, qkv_size, l->qkv_bias, qkv, t, nt);
#pragma omp barrier
#pragma omp for
            for (int64_t r = 0; r < m; ++r) {  /* rotary on q and k, then k and v into the token's cache slot */
                float *row_qkv = qkv + r * qkv_size;
                rotary_token(row_qkv, s->heads + s->kv_heads, s->head_dim, cos_sin + r * s->head_dim);
                memcpy(l->k_cache + slots[r] * kv_size, row_qkv + q_size, sizeof(float) * kv_size);
                memcpy(l->v_cache + slots[r] * kv_size, row_qkv + q_size + kv_size, sizeof(float) * kv_size);
            }
            failed |= attention_part(qkv, qkv_size, s->head_dim, l->k_cache, l->v_cache, block_tables, table_width,
                                     seq_lens, attn, m, s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale);
            /* h += attn Wo, then x = norm(h): the o projection lands in `gate_up` (free until the MLP). */
            linear_part(attn, m, q_size, l->o, hidden, NULL, gate_up, t, nt);
#pragma omp barrier
#pragma omp for
            for (int64_t r = 0; r < m; ++r)
                rms_norm_row(h + r * hidden, gate_up + r * hidden, l->post_norm, x + r * hidden, hidden, s->eps);
            linear_part(x, m, hidden, l->gate_up, 2 * inter, NULL, gate_up, t, nt);
#pragma omp barrier
#pragma omp for
            for (int64_t r = 0; r < m; ++r) silu_mul_row(gate_up + r * 2 * inter, act + r * inter, inter);
            linear_part(act, m, inter, l->down, hidden, NULL, x, t, nt);
#pragma omp barrier
        }
#pragma omp for
        for (int64_t r = 0; r < m; ++r)
            rms_norm_row(h + r * hidden, model->num_layers ? x + r * hidden : NULL, model->final_norm, x + r * hidden,
                         hidden, s->eps);
        linear_part(x, m, hidden, model->lm_head, s->vocab, NULL, logits, t, nt);
        if (greedy != NULL) {
            /* Scanned by the thread that wrote them, while they are in its cache (read back later by
             * one thread they cost ~80 us a row); then the threads' winners are compared in column
             * order, so the result is argmax_row's over the whole row: first NaN, else first max. */
            int64_t p0, p1;
            part_panels(m, hidden, s->vocab, t, nt, &p0, &p1);
            const int64_t c0 = p0 * PANEL, c1 = p1 * PANEL < s->vocab ? p1 * PANEL : s->vocab;
            for (int64_t r = 0; r < m; ++r)
                part_best[t * m + r] = c1 > c0 ? c0 + argmax_row(logits + r * s->vocab + c0, c1 - c0) : -1;
#pragma omp barrier
#pragma omp for
            for (int64_t r = 0; r < m; ++r) {
                const float *row_logits = logits + r * s->vocab;
                int64_t best = -1;
                for (int u = 0; u < nt; ++u) {
                    const int64_t i = part_best[u * m + r];
                    if (i < 0) continue;
                    const float v = row_logits[i];
                    if (v != v) {  /* NaN: the first one wins */
                        best = i;
                        break;
                    }
                    if (best < 0 || v > row_logits[best]) best = i;
                }
                greedy[r] = best;
            }
        }
    }
    free(part_best);
    return failed;
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
