/* The fused decode step's description of a model and of a step (decode_step.c), shared with
 * the loops built on it (decode_steps, and greedy speculation in speculate.c).
 */
#ifndef PAGEDLLM_DECODE_STEP_H
#define PAGEDLLM_DECODE_STEP_H

#include "kernels.h"

typedef struct {
    Matrix qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or NULL */
    float *k_cache, *v_cache;            /* [num_blocks, block_size, num_kv_heads, head_dim] */
    int64_t window;                      /* <= 0: no sliding window */
} Layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, block_size;
    float eps, attn_scale;
    const float *embed;      /* [vocab, hidden] */
    const float *cos, *sin;  /* [max_position, head_dim]; sin's first half negated (rotary.py) */
    const float *final_norm; /* [hidden] */
    const Matrix *lm_head;
    const Layer *layers;
} Model;

typedef struct {
    int64_t rows;
    const int64_t *token_ids, *positions, *slots, *ctx_lens; /* [rows] */
    const int64_t *block_tables;                             /* [rows, max_blocks] */
    int64_t max_blocks;
    const int64_t *logit_rows; /* [num_logits] */
    int64_t num_logits;
    float *logits; /* [num_logits, vocab] */
} Step;

/* The pool slot of `position` in a sequence whose block table is `table`. */
static inline int64_t slot_of(const int64_t *table, int64_t position, int64_t block_size) {
    return table[position / block_size] * block_size + position % block_size;
}

/* One decode step of st->rows rows on num_threads threads: every row's K/V written at its slot,
 * the logits of st->logit_rows. 0 on success; 1 out of memory; 2 an unsupported head shape. */
int decode_step(const Model *md, const Step *st, int num_threads);

#endif
