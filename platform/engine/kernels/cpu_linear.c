/* The linear layers' matmul: packing a weight into column panels, and the entry point that shares a
 * product's panels among threads (the tiles: cpu_linear.h). */
#include "cpu_linear.h"

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
/* panels_product_any (cpu_linear.h). */
PDSERVE_INTERNAL void panels_product_any(const float *x, int64_t m, int64_t whole_m, int64_t k, const void *packed,
                                         int wbf16, int64_t p0, int64_t p1, int64_t n, const float *bias, float *out,
                                         int64_t ldo) {
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
