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
    int64_t embed_rows;   /* token ids the embedding has rows for (vocab: the LM head's columns) */
    int64_t num_blocks;   /* blocks of every layer's KV caches */
    int64_t max_position; /* rows of the rotary tables */
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
    int64_t logits_capacity; /* floats allocated at logits */
} Step;

/* The pool slot of `position` in a sequence whose block table is `table`. */
static inline int64_t slot_of(const int64_t *table, int64_t position, int64_t block_size) {
    return table[position / block_size] * block_size + position % block_size;
}

/* One decode step of st->rows rows on num_threads threads: every row's K/V written at its slot,
 * the logits of st->logit_rows. KERNEL_OK; KERNEL_NO_MEMORY; KERNEL_BAD_SHAPE (head shape);
 * KERNEL_REFUSED: a size or index of the model or the step outside its buffer, nothing computed. */
int decode_step(const Model *md, const Step *st, int num_threads);
/* The checks decode_step makes before it computes anything; `extra` more positions past each
 * row's (multi-step calls) must fit the tables and the rotary tables too. */
int check_model(const Model *md);
int check_step(const Model *md, const Step *st, int64_t extra);

#endif
