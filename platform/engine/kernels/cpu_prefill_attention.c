/* Prefill attention, on the matmul's tiles (cpu_linear.h).
 * One sequence's chunk of q_len queries at positions [context_len - q_len, context_len), causal
 * over the K and V of positions [0, context_len) in the paged cache (the chunk's own are written
 * there first, so this reads them as the cache holds them, like every other path). Per KV head,
 * its K is widened into panels as a linear layer's weight of context_len outputs and its V, as
 * V^T's, one of head_dim outputs, so both products run on the matmul tiles above; then per block
 * of PREFILL_Q_TOKENS query tokens: the scores of the group's query heads for the keys up to the
 * block's last position, an exact softmax per row (a row holds at most context_len scores, so no
 * running rescale is needed), and scores @ V. Masked keys cost at most a block's width per row;
 * torch's CPU flash attention skips them only in 256 x 512 tiles (on a Zen 3 core it ran a causal
 * 1,280-token prefill at 45 GFLOP/s against 70 for the same shapes unmasked).
 * With a sliding window W, the query at position p sees keys (p - W, p]: only the blocks from the
 * chunk's first query's window on are packed (a sliding layer's table may hold placeholders before
 * them), and a block of queries scores only the panels its windows reach. */
#include "cpu_attention.h"
#include "cpu_linear.h"

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

/* Softmax of s[lo, n) in place (s[0, lo) and s[n, width) zeroed); returns 1 / the sum of the
 * exponentials. */
static float softmax_row(float *s, int64_t lo, int64_t n, int64_t width) {
    float max = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < lo; ++j) s[j] = 0.0f;
    s += lo, n -= lo, width -= lo;
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

/* One KV head's share of the chunk (its panels packed in kp, vp, from the context's token 0, which
 * `context_len` counts from): out rows of the group's query heads. `window` > 0: each query sees its
 * last `window` positions only. */
static void prefill_head(const float *q, int64_t q_token_stride, int64_t q_head_stride, int64_t q_len,
                         int64_t context_len, int64_t window, int64_t kv_head, int64_t group, int64_t head_dim,
                         float scale, const float *kp, const float *vp, int64_t len_pad, float *qs, float *scores,
                         float *acc, float *out, int64_t out_token_stride) {
    const int64_t first_pos = context_len - q_len, dims = (head_dim + PANEL - 1) / PANEL * PANEL;
    float *inv = acc + PREFILL_Q_TOKENS * group * dims;
    for (int64_t i0 = 0; i0 < q_len; i0 += PREFILL_Q_TOKENS) {
        const int64_t i1 = i0 + PREFILL_Q_TOKENS < q_len ? i0 + PREFILL_Q_TOKENS : q_len, rows = (i1 - i0) * group;
        const int64_t keys = (first_pos + i1 + PANEL - 1) / PANEL * PANEL;  /* the block's last query sees fewer */
        /* Keys [k0, keys) are scored: the panels from the block's first query's window on. */
        const int64_t seen = window > 0 ? first_pos + i0 - window + 1 : 0;
        const int64_t k0 = seen > 0 ? seen / PANEL * PANEL : 0, width = keys - k0;
        /* Row r: query token i0 + r / group, head kv_head * group + r % group, scaled. */
        for (int64_t r = 0; r < rows; ++r) {
            const float *src = q + (i0 + r / group) * q_token_stride + (kv_head * group + r % group) * q_head_stride;
            for (int64_t d = 0; d < head_dim; ++d) qs[r * head_dim + d] = src[d] * scale;
        }
        panels_product(qs, rows, rows, head_dim, kp, 0, k0 / PANEL, keys / PANEL, keys, NULL, scores, width);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t pos = first_pos + i0 + r / group;
            const int64_t lo = window > 0 && pos - window + 1 > k0 ? pos - window + 1 : k0;
            inv[r] = softmax_row(scores + r * width, lo - k0, pos + 1 - k0, width);
        }
        for (int64_t p = 0; p < dims / PANEL; ++p) {
            const int64_t cols = head_dim - p * PANEL < PANEL ? head_dim - p * PANEL : PANEL;
            linear_tiles(scores, rows, width, vp + (p * len_pad + k0) * PANEL, 0, acc + p * PANEL, dims, cols, NULL);
        }
        for (int64_t r = 0; r < rows; ++r) {
            float *dst = out + (i0 + r / group) * out_token_stride + (kv_head * group + r % group) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[r * dims + d] * inv[r];
        }
    }
}

/* out [q_len, num_heads, head_dim] (token stride out_token_stride): see the section's comment;
 * `window` 0 for none. The KV heads are shared among the threads (a thread packs its own). Returns
 * 0 on success, 1 when scratch memory could not be allocated. */
int pdserve_paged_prefill_attention_f32(const float *q, int64_t q_token_stride, int64_t q_head_stride,
                                        const void *k_cache, const void *v_cache, int kv_bf16, const int64_t *table,
                                        int64_t context_len, int64_t q_len, float *out, int64_t out_token_stride,
                                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                        int64_t block_size, int64_t window, float scale, int num_threads) {
    /* With a window, the context starts at the block of the first query's first key. */
    const int64_t seen = window > 0 ? context_len - q_len - window + 1 : 0;
    const int64_t skipped_blocks = seen > 0 ? seen / block_size : 0;
    table += skipped_blocks;
    context_len -= skipped_blocks * block_size;
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
            prefill_head(q, q_token_stride, q_head_stride, q_len, context_len, window, h, group, head_dim, scale, kp,
                         vp, len_pad, qs, scores, qs + max_rows * head_dim, out, out_token_stride);
        }
    }
    return failed;
}
