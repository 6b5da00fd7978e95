/* Paged decode attention for fp32 on CPU: one pass over each sequence's KV blocks, in place.
 *
 * The torch path gathers a batch's blocks into one padded buffer and runs SDPA over it: the KV
 * bytes cross memory three times, and every sequence pays for the longest one. Here each
 * (sequence, KV head) pair reads its own blocks straight from the cache, once: scores for the
 * query heads that share the KV head (GQA), a softmax, then the weighted sum of V.
 *
 * Layouts (row-major; strides in elements):
 *   q            [batch, num_heads, head_dim]       q_batch_stride, q_head_stride; last dim dense
 *   k_cache      [num_blocks, block_size, num_kv_heads, head_dim]   dense (one layer's K half)
 *   v_cache      same as k_cache
 *   block_tables [batch, table_width] int64, dense
 *   seq_lens     [batch] int64
 *   out          [batch, num_heads, head_dim]       dense
 *
 * Built by cpu_attention.py with the system C compiler (-O3 -march=native -fopenmp); loaded after
 * torch, so `libgomp.so.1` resolves to the OpenMP runtime torch already runs (one thread pool).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* One (sequence, KV head): `group` query heads at q (stride q_head_stride) against `len` tokens.
 * scores: scratch of group * len floats. acc: scratch of group * head_dim floats. */
static void attend(const float *q, int64_t q_head_stride, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t len, int64_t kv_head, int64_t group, int64_t head_dim,
                   int64_t block_size, int64_t token_stride, float scale, float *scores, float *acc,
                   float *out) {
    const int64_t block_stride = block_size * token_stride;
    const int64_t head_offset = kv_head * head_dim;

    /* Pass 1: scores, reading each K row once for all the group's query heads. */
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const float *kb = k_cache + table[blk] * block_stride + head_offset;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; ++i) {
            const float *k = kb + i * token_stride;
            for (int64_t g = 0; g < group; ++g)
                scores[g * len + t0 + i] = dot(q + g * q_head_stride, k, head_dim) * scale;
        }
    }
    /* Softmax per query head; the normaliser is applied to the output at the end. */
    float inv_sum[group];
    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * len;
        float m = s[0];
        for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        inv_sum[g] = 1.0f / sum;
    }
    /* Pass 2: the weighted sum of V, reading each V row once. */
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const float *vb = v_cache + table[blk] * block_stride + head_offset;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; ++i) {
            const float *v = vb + i * token_stride;
            for (int64_t g = 0; g < group; ++g) axpy(acc + g * head_dim, scores[g * len + t0 + i], v, head_dim);
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int pdserve_paged_decode_attention_f32(const float *q, int64_t q_batch_stride, int64_t q_head_stride,
                                       const float *k_cache, const float *v_cache, const int64_t *block_tables,
                                       int64_t table_width, const int64_t *seq_lens, float *out, int64_t batch,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; ++b) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * (max_len > 0 ? max_len : 1));
        float *acc = malloc(sizeof(float) * group * head_dim);
        if (scores == NULL || acc == NULL) failed = 1;
        /* Every thread takes part in the loop (a worksharing construct must be met by all). */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < batch; ++b) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                if (scores == NULL || acc == NULL || seq_lens[b] <= 0) continue;
                attend(q + b * q_batch_stride + h * group * q_head_stride, q_head_stride, k_cache, v_cache,
                       block_tables + b * table_width, seq_lens[b], h, group, head_dim, block_size,
                       token_stride, scale, scores, acc, out + (b * num_heads + h * group) * head_dim);
            }
        }
        free(scores);
        free(acc);
    }
    return failed;
}
