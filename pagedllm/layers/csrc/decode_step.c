/* A whole decode step of a Llama-family model in one call, for a few rows (decode tokens and
 * speculative verification rows, M <= 16): embedding, every layer, the final norm and the logits
 * of the rows that sample.
 *
 * Why one call: at these sizes a step's time should be the time to read the weights once, but
 * run as PyTorch ops a layer is ~15 dispatches, each paying the dispatcher's own cache misses
 * after a matmul has streamed its weights through the caches, and the matmuls themselves stop
 * short of the memory's speed. Here the threads enter one OpenMP parallel region for the whole
 * step and meet at a barrier only where the next stage needs all of the last one's outputs
 * (five times a layer). Between barriers each thread streams its own contiguous share of a
 * packed weight (small_matmul.c) and applies the epilogue — bias, residual add, SiLU x up —
 * while the outputs are in registers.
 *
 * A layer, for rows r and threads t:
 *   h_t   = rmsnorm(x) * w_in          (each thread its own copy: cheaper than a barrier)
 *   qkv   = h_t W_qkv^T (+ b)          (panels split over threads)                  | barrier
 *   per (row, KV head): q/k RMSNorm (Qwen3), rotary, K/V written to the row's slot  | barrier
 *   per (row, KV head): paged attention over the row's context (paged_decode.c)    | barrier
 *   x    += attn W_o^T (+ b)                                                        | barrier
 *   h_t   = rmsnorm(x) * w_post
 *   act   = silu(h_t W_gate^T) * (h_t W_up^T)                                       | barrier
 *   x    += act W_down^T (+ b)                                                      | barrier
 * then rmsnorm of the sampled rows and their logits over the (tied or not) LM head's panels.
 *
 * The arithmetic is that of the PyTorch modules (models/llama.py) in fp32, in a different order
 * of summation; results are tested against them.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static void rmsnorm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / __builtin_sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* x * cos + swap_halves(x) * sin, in place (the sign of rotate_half lives in the sin table). */
static void rotate(float *x, const float *cos, const float *sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* q/k norms, rotary and the K/V writes for row r's KV head h (and its G query heads). */
static void prepare_head(const Model *md, const Layer *ly, const Step *st, float *qkv, int64_t ld, int64_t r, int64_t h) {
    const int64_t D = md->head_dim, G = md->num_heads / md->num_kv_heads, Hkv = md->num_kv_heads;
    float *row = qkv + r * ld;
    float *k = row + md->num_heads * D + h * D;
    const float *v = row + (md->num_heads + Hkv) * D + h * D;
    const float *cos = md->cos + st->positions[r] * D, *sin = md->sin + st->positions[r] * D;
    for (int64_t g = 0; g < G; g++) {
        float *q = row + (h * G + g) * D;
        if (ly->q_norm != NULL) rmsnorm(q, ly->q_norm, D, md->eps, q);
        rotate(q, cos, sin, D);
    }
    if (ly->k_norm != NULL) rmsnorm(k, ly->k_norm, D, md->eps, k);
    rotate(k, cos, sin, D);
    const int64_t at = (st->slots[r] * Hkv + h) * D;
    memcpy(ly->k_cache + at, k, sizeof(float) * D);
    memcpy(ly->v_cache + at, v, sizeof(float) * D);
}

typedef struct {
    float *x, *norm, *qkv, *attn, *act;
    int64_t qkv_ld, norm_ld;
} Scratch;

/* One layer, run by every thread of the region; returns nonzero if attention ran out of memory. */
static int layer_step(const Model *md, const Layer *ly, const Step *st, const Scratch *sc, int t, int nt) {
    const int64_t R = st->rows, H = md->hidden, D = md->head_dim, Hkv = md->num_kv_heads;
    const int64_t q_width = md->num_heads * D;
    const Shape shape = {md->block_size, Hkv, md->num_heads / Hkv, D};
    float *norm = sc->norm + t * sc->norm_ld;
    int64_t lo, hi;
    int failed = 0;

    for (int64_t r = 0; r < R; r++) rmsnorm(sc->x + r * H, ly->input_norm, H, md->eps, norm + r * H);
    thread_share(ly->qkv.num_panels, t, nt, &lo, &hi);
    matmul_panels(&ly->qkv, norm, R, H, sc->qkv, sc->qkv_ld, lo, hi, STORE);
#pragma omp barrier
    thread_share(R * Hkv, t, nt, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) prepare_head(md, ly, st, sc->qkv, sc->qkv_ld, i / Hkv, i % Hkv);
#pragma omp barrier
    for (int64_t i = lo; i < hi; i++) {
        const int64_t r = i / Hkv, h = i % Hkv;
        failed |= attend_sequence(sc->qkv + r * sc->qkv_ld, ly->k_cache, ly->v_cache, st->block_tables + r * st->max_blocks,
                                  st->ctx_lens[r], ly->window, md->attn_scale, shape, h, h + 1, sc->attn + r * q_width);
    }
#pragma omp barrier
    thread_share(ly->o.num_panels, t, nt, &lo, &hi);
    matmul_panels(&ly->o, sc->attn, R, q_width, sc->x, H, lo, hi, ACCUMULATE);
#pragma omp barrier
    for (int64_t r = 0; r < R; r++) rmsnorm(sc->x + r * H, ly->post_norm, H, md->eps, norm + r * H);
    thread_share(ly->gate_up.num_panels / 2, t, nt, &lo, &hi);
    swiglu_panels(&ly->gate_up, norm, R, H, sc->act, md->intermediate, lo, hi);
#pragma omp barrier
    thread_share(ly->down.num_panels, t, nt, &lo, &hi);
    matmul_panels(&ly->down, sc->act, R, md->intermediate, sc->x, H, lo, hi, ACCUMULATE);
#pragma omp barrier
    return failed;
}

int decode_step(const Model *md, const Step *st, int num_threads) {
    const int64_t R = st->rows, H = md->hidden, D = md->head_dim;
    if (D % 8 != 0 || md->num_heads % md->num_kv_heads != 0) return 2;
    Scratch sc;
    sc.qkv_ld = (md->num_heads + 2 * md->num_kv_heads) * D;
    sc.norm_ld = R * H;
    const int64_t floats = R * H + num_threads * sc.norm_ld + R * sc.qkv_ld + R * md->num_heads * D + R * md->intermediate;
    float *scratch = malloc(sizeof(float) * floats);
    if (scratch == NULL) return 1;
    sc.x = scratch;
    sc.norm = sc.x + R * H;
    sc.qkv = sc.norm + num_threads * sc.norm_ld;
    sc.attn = sc.qkv + R * sc.qkv_ld;
    sc.act = sc.attn + R * md->num_heads * D;
    for (int64_t r = 0; r < R; r++) memcpy(sc.x + r * H, md->embed + st->token_ids[r] * H, sizeof(float) * H);

    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t l = 0; l < md->num_layers; l++) failed |= layer_step(md, &md->layers[l], st, &sc, t, nt);
        float *norm = sc.norm + t * sc.norm_ld;
        for (int64_t i = 0; i < st->num_logits; i++) rmsnorm(sc.x + st->logit_rows[i] * H, md->final_norm, H, md->eps, norm + i * H);
        int64_t lo, hi;
        thread_share(md->lm_head->num_panels, t, nt, &lo, &hi);
        matmul_panels(md->lm_head, norm, st->num_logits, H, st->logits, md->vocab, lo, hi, STORE);
    }
    free(scratch);
    return failed;
}
