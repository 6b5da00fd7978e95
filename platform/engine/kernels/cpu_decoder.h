/* The decode step's state, shared by its two files: cpu_decoder.c (the step: its phases and items,
 * buffers, the API) and cpu_decoder_threads.c (the threads that share its items). */
#ifndef PDSERVE_CPU_DECODER_H
#define PDSERVE_CPU_DECODER_H

#include "cpu_runtime.h"

#include <pthread.h>
#include <stdatomic.h>

/* The model as cpu_kernels.py passes it (ctypes structures of the same layout). */
typedef struct {
    const float *input_norm, *post_norm;                  /* [hidden] */
    const void *qkv;                                      /* packed (pdserve_pack_linear_f32), as o to down */
    const float *qkv_bias;                                /* may be NULL */
    const float *q_norm, *k_norm;                         /* [head_dim], each head's norm before rotary
                                                           * (Qwen3); NULL (both): none */
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

#define MAX_THREADS 255                /* thread index: 8 bits of a state word */

/* Phases: nine per layer, then three. */
enum { K_NORM_IN, K_QKV, K_ROTARY, K_ATTN, K_O, K_NORM_POST, K_GATE_UP, K_SILU, K_DOWN, K_LAYER_KINDS,
       K_NORM_FINAL = K_LAYER_KINDS, K_LM_HEAD, K_ARGMAX, K_KINDS };

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

static inline void stat_add(pdserve_decoder *d, int which) {
    atomic_fetch_add_explicit(&d->stats[which], 1, memory_order_relaxed);
}

/* Phase f of a step: `n` items of one kind (for layer `layer`), their state words from `offset` on. */
typedef struct { int kind; int64_t layer, n, offset; } phase;

/* cpu_decoder.c: the step's work. */
/* Compute item i of phase f into thread w's own buffers (reads shared memory only). */
PDSERVE_INTERNAL void compute_item(const pdserve_decoder *d, worker *w, const step_params *p, const phase *f,
                                  int64_t i);
/* Write item i's results (compute_item's) into the step's buffers: only the thread that won its publish. */
PDSERVE_INTERNAL void publish_item(const pdserve_decoder *d, worker *w, const step_params *p, const phase *f,
                                  int64_t i);
/* Every phase of the step, as thread w; returns early when the step is over without it. */
PDSERVE_INTERNAL void run_step(pdserve_decoder *d, worker *w, const step_params *p);

/* cpu_decoder_threads.c: the threads. */
/* Thread w's part of phase f; 0 when a newer step has begun (w is late: its step is over). */
PDSERVE_INTERNAL int run_phase(pdserve_decoder *d, worker *w, const step_params *p, const phase *f);
PDSERVE_INTERNAL worker *new_worker(pdserve_decoder *d, int index);
/* Start helpers until nt threads can work (fewer if the system refuses); how many can. */
PDSERVE_INTERNAL int ensure_threads(pdserve_decoder *d, int nt);
/* Open step p, of `items` items, to the helpers; the caller then runs it as thread 0. */
PDSERVE_INTERNAL void start_step(pdserve_decoder *d, const step_params *p, int64_t items);
/* Stop and join the helpers (a late one first finishes its item); free every worker. */
PDSERVE_INTERNAL void stop_threads(pdserve_decoder *d);

#endif
