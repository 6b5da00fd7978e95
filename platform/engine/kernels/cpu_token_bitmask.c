/* A grammar's token mask applied to logits (the sampler's constrained rows): one pass from the
 * packed bitmask llguidance fills (1 bit a token, int32 words), no unpacked booleans. On one
 * thread: at batch 64 over a 32k vocabulary it measured 0.6-1.6 ms on a loaded 2-core Xeon VM,
 * where the same loop in a parallel region took 7-46 ms (its threads wait for a core at the
 * barrier). */
#include "cpu_runtime.h"

/* out[r, t] = x[r, t] where bit t % 32 of word t / 32 of mask row r is set, else -inf; tokens from
 * 32 * words on are -inf. Rows of n floats and of `words` int32, dense; out may be x. A word that
 * allows every token is copied whole (an unconstrained row is all such words). */
void pdserve_token_bitmask_f32(const float *x, const int32_t *mask, int64_t rows, int64_t n, int64_t words,
                               float *out) {
    const int64_t covered = n < 32 * words ? n : 32 * words;
    for (int64_t r = 0; r < rows; ++r) {
        const float *src = x + r * n;
        const uint32_t *m = (const uint32_t *)mask + r * words;
        float *dst = out + r * n;
        int64_t t = 0;
        for (; t + 32 <= covered; t += 32) {
            const uint32_t bits = m[t >> 5];
            if (bits == 0xffffffffu) {
                if (dst != src) memcpy(dst + t, src + t, 32 * sizeof(float));
            } else {
                for (int j = 0; j < 32; ++j) dst[t + j] = (bits >> j) & 1u ? src[t + j] : -INFINITY;
            }
        }
        for (; t < covered; ++t) dst[t] = (m[t >> 5] >> (t & 31)) & 1u ? src[t] : -INFINITY;
        for (; t < n; ++t) dst[t] = -INFINITY;
    }
}
