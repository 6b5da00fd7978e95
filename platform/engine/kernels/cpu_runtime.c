/* The runtime the kernels share: per-thread scratch memory, and 2 MiB pages on request. */
#include "cpu_runtime.h"

#include <sys/mman.h>

/* Per-thread scratch that outlives the call (OpenMP's threads persist): long contexts need
 * megabytes of scores, and a fresh allocation that size would be page-faulted in on every call.
 * NULL when it cannot grow. */
PDSERVE_INTERNAL float *scratch(int which, int64_t floats) {
    static __thread float *buf[4];
    static __thread int64_t cap[4];
    if (floats > cap[which]) {
        float *grown = realloc(buf[which], sizeof(float) * floats);
        if (grown == NULL) return NULL;
        buf[which] = grown;
        cap[which] = floats;
    }
    return buf[which];
}


/* Ask the kernel for 2 MiB pages under `bytes` at p (the whole 2 MiB pages inside it), before
 * anything touches them. With 4 KiB pages a GEMV takes a TLB miss every 4 KiB and the hardware
 * prefetcher restarts at each page boundary; this machine class has transparent huge pages only
 * on request ("madvise"). Best effort: where the kernel says no, nothing changes. */
void pdserve_want_huge_pages(void *p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}
