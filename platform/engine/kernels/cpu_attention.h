/* Paged attention's shared pieces: a sequence's cache rows through its block table, and decode
 * attention's core (`attend`, cpu_decode_attention.c), which the decode step (cpu_decoder.c) also
 * runs as its attention items.
 *
 * Layouts (row-major; strides in elements):
 *   q            [batch, num_heads, head_dim]       q_batch_stride, q_head_stride; last dim dense
 *   k_cache      [num_blocks, block_size, num_kv_heads, head_dim]   dense (one layer's K half)
 *   v_cache      same as k_cache
 *   block_tables [batch, table_width] int64, dense
 *   seq_lens     [batch] int64
 *   out          [batch, num_heads, head_dim]       dense
 * The caches hold fp32, or bf16 with `kv_bf16` (cpu_runtime.h). */
#ifndef PDSERVE_CPU_ATTENTION_H
#define PDSERVE_CPU_ATTENTION_H

#include "cpu_runtime.h"

/* Token t's row of a sequence's cache (strides in bytes). */
static inline const char *row(const char *cache, const int64_t *table, int64_t t, int64_t block_size,
                              int64_t block_stride, int64_t token_stride) {
    return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
}

/* One sequence's KV heads [h0, h1) against its `len` tokens, of which the first `skip` (fewer than
 * a block: a sliding window's start inside its first block) get no weight; each KV head serves `group` query
 * heads (q row h * group + g, stride q_head_stride; out rows likewise, dense). Rows of all the
 * heads of a token are adjacent in the cache, so reading them together streams whole blocks.
 * token_stride: elements from one token's row to the next (fp32, or bf16 with kv_bf16).
 * scores: scratch of (h1 - h0) * group * len floats; acc: (h1 - h0) * group * head_dim floats;
 * out: the rows of heads [h0, h1)' query heads, from h0 * group's on, dense. */
PDSERVE_INTERNAL void attend(const float *q, int64_t q_head_stride, const void *k_cache, const void *v_cache,
                             int kv_bf16, const int64_t *table, int64_t len, int64_t skip, int64_t h0, int64_t h1,
                             int64_t group,
                             int64_t head_dim, int64_t block_size, int64_t token_stride, float scale, float *scores,
                             float *acc, float *out);

/* KV heads per attention work item for `batch` sequences on `threads` threads: all of a
 * sequence's (its rows stream whole, where one KV head's slices of them read cold came ~1.25x
 * slower) on one thread or with sequences enough to keep every thread busy; else one, for more
 * items to share. */
static inline int64_t attention_heads_per_item(int64_t batch, int64_t threads, int64_t kv_heads) {
    return threads == 1 || batch >= 4 * threads ? kv_heads : 1;
}

#endif
