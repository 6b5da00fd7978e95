/* Greedy sampling's argmax over rows of logits (cpu_argmax.c); the decode step (cpu_decoder.c)
 * runs `argmax_row` over its LM head's columns. */
#ifndef PDSERVE_CPU_ARGMAX_H
#define PDSERVE_CPU_ARGMAX_H

#include "cpu_runtime.h"

/* The first index of v's largest value, or of its first NaN if it has one (torch's argmax): one
 * vector pass for the maximum (and whether any value is NaN), then one for where it first occurs. */
PDSERVE_INTERNAL int64_t argmax_row(const float *v, int64_t n);

#endif
