/* What the fused decode step (decode_step.c) lends the loops built on it (decode_steps, and
 * greedy speculation in speculate.c); its Model, Step and entry points are in interface.h.
 */
#ifndef PAGEDLLM_DECODE_STEP_H
#define PAGEDLLM_DECODE_STEP_H

#include "kernels.h"

/* The pool slot of `position` in a sequence whose block table is `table`. */
static inline int64_t slot_of(const int64_t *table, int64_t position, int64_t block_size) {
    return table[position / block_size] * block_size + position % block_size;
}

/* The checks decode_step makes before it computes anything; `extra` more positions past each
 * row's (multi-step calls) must fit the tables and the rotary tables too. */
int check_model(const Model *md);
int check_step(const Model *md, const Step *st, int64_t extra);

#endif
