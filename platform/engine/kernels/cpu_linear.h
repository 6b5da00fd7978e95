/* Linear layers: y = x W^T + b over W packed in column panels.
 * oneDNN's and MKL's matmuls are built for large problems; at decode batch sizes (1-64 rows) they
 * stream these models' weights at 60-75% of what the memory can deliver. The packed layout here
 * stores W `[N, K]` as panels of 16 output columns, `[ceil(N / 16), K, 16]` (zero-padded), so:
 * - one row of x (batch-1 decode) reads the weights as one contiguous stream per thread;
 * - several rows use register tiles: with AVX2 up to 6 x 16 (per k, two weight vectors and six
 *   broadcasts of x feed twelve FMAs), with AVX-512 up to 12 x 16 (one weight vector, twelve
 *   FMAs of twice the width: 2x the rows per cycle), so from a few rows on the loop runs at the
 *   cores' FMA rate, not the memory's; a panel (16 x K weights) stays in cache while every row
 *   block passes over it.
 * Threads split the panels; rows are taken in blocks whose x fits in L2 (prefill chunks).
 *
 * This header holds the register tiles, inlined wherever a product runs over packed panels (the
 * linear layers, prefill attention, the decode step's matmul items); cpu_linear.c the packing
 * and the entry point. */
#ifndef PDSERVE_CPU_LINEAR_H
#define PDSERVE_CPU_LINEAR_H

#include "cpu_runtime.h"

#define PANEL 16

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

/* panels_product for each kind of panel (cpu_linear.c). */
PDSERVE_INTERNAL void panels_product_any(const float *x, int64_t m, int64_t whole_m, int64_t k, const void *packed,
                                         int wbf16, int64_t p0, int64_t p1, int64_t n, const float *bias, float *out,
                                         int64_t ldo);

#endif
