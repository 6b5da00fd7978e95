/* Paged decode attention: one query token per sequence, over the sequence's KV blocks.
 *
 * The torch path gathers a batch's blocks into one padded buffer and runs SDPA over it, so the KV
 * bytes cross memory three times and every sequence pays for the longest one. Here each sequence
 * (or, at small batches, each of its KV heads) reads its own blocks straight from the cache, once:
 * scores for the query heads that share a KV head (GQA), a softmax, then the weighted sum of V.
 * Layouts: cpu_attention.h. */
#include "cpu_attention.h"

#ifdef HAVE_AVX2
/* [sum(a0), ..., sum(a7)] */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                           __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

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

/* `attend` (cpu_attention.h). */
PDSERVE_INTERNAL void attend(const float *q, int64_t q_head_stride, const void *k_cache, const void *v_cache,
                             int kv_bf16, const int64_t *table, int64_t len, int64_t skip, int64_t h0, int64_t h1,
                             int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride, float scale,
                             float *scores, float *acc, float *out) {
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

    /* Softmax per query head over tokens [skip, len) (the skipped ones weigh 0 in pass 2); the
     * normaliser is applied to the output at the end. */
    float inv_sum[rows];
    const int64_t n = len - skip;
    for (int64_t r = 0; r < rows; ++r) {
        memset(scores + r * len, 0, sizeof(float) * skip);
        float *s = scores + r * len + skip;
        float m = s[0];
        for (int64_t i = 1; i < n; ++i) m = s[i] > m ? s[i] : m;
        float sum = 0.0f;
        int64_t i = 0;
#ifdef HAVE_AVX2
        __m256 mv = _mm256_set1_ps(m), sv = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
            _mm256_storeu_ps(s + i, e);
            sv = _mm256_add_ps(sv, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, sv);
        for (int j = 0; j < 8; ++j) sum += lanes[j];
#endif
        for (; i < n; ++i) {
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

/* One thread's part of paged decode attention, inside a parallel region every thread of the team
 * calls it from (its work items are a worksharing loop, whose end is a barrier). Returns 1 when
 * this thread's scratch could not be allocated (its items are then left unwritten), else 0. */
static int attention_part(const float *q, int64_t q_batch_stride, int64_t q_head_stride, const void *k_cache,
                          const void *v_cache, int kv_bf16, const int64_t *block_tables, int64_t table_width,
                          const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; ++b) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    if (window > 0 && max_len > window + block_size) max_len = window + block_size;  /* the most one reads */
    const int64_t heads_per_item = attention_heads_per_item(batch, omp_get_num_threads(), num_kv_heads);
    const int64_t items_per_seq = num_kv_heads / heads_per_item;
    const int64_t rows = heads_per_item * group;
    float *scores = scratch(0, rows * (max_len > 0 ? max_len : 1));
    float *acc = scratch(1, rows * head_dim);
    /* Every thread takes part in the loop (a worksharing construct must be met by all). */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * items_per_seq; ++item) {
        const int64_t b = item / items_per_seq, h0 = (item % items_per_seq) * heads_per_item;
        const int64_t len = seq_lens[b];
        if (scores == NULL || acc == NULL || len <= 0) continue;
        /* A window reads from the block of its first position (len - window) on: earlier entries
         * of a sliding layer's table may be placeholders. */
        const int64_t first = window > 0 && len > window ? len - window : 0, skipped = first / block_size * block_size;
        attend(q + b * q_batch_stride, q_head_stride, k_cache, v_cache, kv_bf16,
               block_tables + b * table_width + first / block_size, len - skipped, first - skipped,
               h0, h0 + heads_per_item, group, head_dim, block_size, token_stride, scale, scores, acc,
               out + b * num_heads * head_dim + h0 * group * head_dim);
    }
    return scores == NULL || acc == NULL;
}

/* `window` > 0: each sequence's query (position len - 1) sees its last `window` positions only (a
 * sliding-window layer: keys at positions > len - 1 - window), and its table is read from that
 * window's first block on; 0: all `len`. Returns 0 on success, 1 when scratch memory could not be
 * allocated. */
int pdserve_paged_decode_attention_f32(const float *q, int64_t q_batch_stride, int64_t q_head_stride,
                                       const void *k_cache, const void *v_cache, int kv_bf16,
                                       const int64_t *block_tables,
                                       int64_t table_width, const int64_t *seq_lens, float *out, int64_t batch,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, int64_t window, float scale, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    failed = attention_part(q, q_batch_stride, q_head_stride, k_cache, v_cache, kv_bf16, block_tables, table_width,
                            seq_lens, out, batch, num_heads, num_kv_heads, head_dim, block_size, window, scale);
    return failed;
}
