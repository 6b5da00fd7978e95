/* A whole decode step in one call, token ids to logits.
 * Called one by one from Python, a layer's eleven kernels pay for module calls, views, checks and
 * ctypes between them. For a dense Llama-family model in fp32 with every linear packed for
 * pdserve_linear_f32 (fp32 or bf16 panels, all alike), a decode-only step (one new token per
 * sequence, every row sampled) runs here from token ids to logits, with the same row functions and
 * matmul tiles as those kernels:
 *   h = embedding[id]; per layer:
 *     x = norm(h); qkv = x Wqkv (+b); (Qwen3: each q and k head normalised;) rotary(q, k);
 *     cache[slot] = k, v; a = attention(q);
 *     h += a Wo; x = norm(h); h += (silu(x Wg) * x Wu) Wd
 *   logits = norm(h) Wlm, and with greedy sampling each row's argmax.
 *
 * This file: the step's phases and items, its buffers and the API (`pdserve_decoder_*`, bound by
 * cpu_kernels.py). Its threads, and how they share a step's items without ever waiting on one
 * another: cpu_decoder_threads.c; the state both files share: cpu_decoder.h. Each item is computed
 * the same way whichever thread computes it, so results do not depend on the thread count or on
 * who did what. */
#include "cpu_decoder.h"

#include "cpu_argmax.h"
#include "cpu_attention.h"
#include "cpu_elementwise.h"
#include "cpu_linear.h"

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

/* Attention item i of step p: row *r's query heads of KV heads [*g, *g + *heads). */
static void attention_item(const pdserve_decoder *d, const step_params *p, int64_t i, int64_t *r, int64_t *g,
                           int64_t *heads) {
    *heads = attention_heads_per_item(p->m, p->nt, d->s.kv_heads);
    const int64_t per_row = d->s.kv_heads / *heads;
    *r = i / per_row;
    *g = i % per_row * *heads;
}

PDSERVE_INTERNAL void compute_item(const pdserve_decoder *d, worker *w, const step_params *p, const phase *f, int64_t i) {
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
    case K_ROTARY:  /* q and k (with Qwen3's norms, each head) rotated (the cache write is the publish's) */
        memcpy(t->row_a, b->qkv + i * d->qkv_size, sizeof(float) * (d->q_size + d->kv_size));
        if (l->q_norm != NULL)
            for (int64_t h = 0; h < s->heads + s->kv_heads; ++h) {
                float *head = t->row_a + h * s->head_dim;
                rms_norm_row(head, NULL, h < s->heads ? l->q_norm : l->k_norm, head, s->head_dim, s->eps);
            }
        rotary_token(t->row_a, s->heads + s->kv_heads, s->head_dim, d->model.cos_sin + b->positions[i] * s->head_dim);
        break;
    case K_ATTN: {
        int64_t r, g, heads;
        attention_item(d, p, i, &r, &g, &heads);
        attend(b->qkv + r * d->qkv_size, s->head_dim, l->k_cache, l->v_cache, (int)s->kv_bf16, b->tables + r * b->w_cap,
               b->lens[r], 0,
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

PDSERVE_INTERNAL void publish_item(const pdserve_decoder *d, worker *w, const step_params *p, const phase *f, int64_t i) {
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

/* run_step (cpu_decoder.h). */
PDSERVE_INTERNAL void run_step(pdserve_decoder *d, worker *w, const step_params *p) {
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
    stop_threads(d);
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
    const step_params p = {++d->last_tag, m, nt, b, logits, greedy};
    start_step(d, &p, total_items(d, m));
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
