/* The decode step's threads (cpu_decoder.c computes the items; cpu_decoder.h: the state).
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
 * Only this file reads and writes the state words, the seqlock and the futex. */
#include "cpu_decoder.h"

#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SPIN_NS 50000                  /* a helper spins this long after a step before it sleeps */
#define REDO_MIN_NS 20000              /* wait at least this long before redoing another thread's item */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* An item's state word: the step's tag (48 bits), the state, the thread that set it. */
enum { ST_FREE, ST_CLAIMED, ST_STORING, ST_DONE };
static inline uint64_t state_word(uint64_t tag, int state, int who) {
    return tag << 16 | (uint64_t)state << 8 | (uint64_t)who;
}
static inline int state_of(uint64_t w) { return (int)(w >> 8 & 0xff); }
static inline int who_of(uint64_t w) { return (int)(w & 0xff); }
static inline int tagged(uint64_t w, uint64_t tag) { return (w >> 16) == (tag & 0xffffffffffffull); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
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

/* run_phase (cpu_decoder.h): its share from the front, then the others' from their ends. */
PDSERVE_INTERNAL int run_phase(pdserve_decoder *d, worker *w, const step_params *p, const phase *f) {
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

PDSERVE_INTERNAL worker *new_worker(pdserve_decoder *d, int index) {
    worker *w = NULL;
    if (posix_memalign((void **)&w, 64, sizeof(worker)) == 0) {
        memset(w, 0, sizeof(worker));
        w->dec = d;
        w->index = index;
        w->rng = 0x9e3779b97f4a7c15ull * (uint64_t)(index + 1);
    }
    return w;
}

/* ensure_threads (cpu_decoder.h). */
PDSERVE_INTERNAL int ensure_threads(pdserve_decoder *d, int nt) {
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

/* start_step (cpu_decoder.h): every item free under the step's tag, the step published for
 * read_step (a seqlock), then the helpers that sleep woken. */
PDSERVE_INTERNAL void start_step(pdserve_decoder *d, const step_params *p, int64_t items) {
    for (int64_t i = 0; i < items; ++i)
        atomic_store_explicit(&p->buf->states[i], state_word(p->tag, ST_FREE, 0), memory_order_relaxed);
    const uint64_t seq = atomic_load_explicit(&d->pseq, memory_order_relaxed);
    atomic_store_explicit(&d->pseq, seq + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&d->p_tag, p->tag, memory_order_relaxed);
    atomic_store_explicit(&d->p_m, p->m, memory_order_relaxed);
    atomic_store_explicit(&d->p_nt, p->nt, memory_order_relaxed);
    atomic_store_explicit(&d->p_buf, p->buf, memory_order_relaxed);
    atomic_store_explicit(&d->p_logits, p->logits, memory_order_relaxed);
    atomic_store_explicit(&d->p_greedy, p->greedy, memory_order_relaxed);
    atomic_store_explicit(&d->pseq, seq + 2, memory_order_release);
    if (p->nt > 1) {
        atomic_store(&d->wake, (uint32_t)p->tag);
        if (atomic_load(&d->sleepers) > 0) futex_wake(&d->wake);
    }
}

/* stop_threads (cpu_decoder.h). */
PDSERVE_INTERNAL void stop_threads(pdserve_decoder *d) {
    atomic_store(&d->quit, 1);
    atomic_fetch_add(&d->wake, 1);
    futex_wake(&d->wake);
    for (int i = 1; i < d->num_workers; ++i) pthread_join(d->workers[i]->thread, NULL);
    for (int i = 0; i < d->num_workers; ++i) free(d->workers[i]);
}
