/* A whole decode step of a Llama-family model in one call, for a few rows (decode tokens and
 * speculative verification rows, M <= 16): embedding, every layer, the final norm and the logits
 * of the rows that sample.
 *
 * Why one call: at these sizes a step's time should be the time to read the weights once, but
 * run as PyTorch ops a layer is ~15 dispatches, each paying the dispatcher's own cache misses
 * after a matmul has streamed its weights through the caches, and the matmuls themselves stop
 * short of the memory's speed. Here the threads enter one OpenMP parallel region for the whole
 * step. A step is a fixed sequence of stages, each a set of chunks (a few panels of a packed
 * weight, or one (row, KV head) of attention); a thread claims a stage's chunks one at a time
 * through atomics (a matrix's: its own share first, see Walk), streams its chunk's weights
 * (small_matmul.c) and applies the epilogue
 * — bias, residual add, SiLU x up — while the outputs are in registers, and moves to the next
 * stage once every chunk of this one is done. Why not OpenMP barriers: on a machine whose cores
 * are shared (a co-runner, or both threads put on one core) a barrier waits for every thread
 * to *arrive*, so each of a step's ~180 barriers waited for a descheduled thread's next time
 * slice, and libgomp's waiters spin before sleeping: a single-stream step went from 14 ms to
 * 330 ms. Here a descheduled thread that holds no chunk blocks nobody (the other does the rest
 * of the stage), and waiters yield the core after a short spin.
 *
 * A layer's stages, for rows r (each thread first computes its own copy of a norm it needs):
 *   qkv   = rmsnorm(x) W_qkv^T (+ b)                         chunks of panels
 *   per (row, KV head): q/k RMSNorm (Qwen3), rotary, K/V written to the row's slot (a step of
 *                       one sequence without adapters does this in the attention items instead)
 *   per (sequence, KV heads, part of its context): paged attention (paged_decode.c), a context
 *                       longer than ATTEND_PART positions in parts merged by the last to finish
 *   x    += attn W_o^T (+ b)                                  chunks of panels
 *   act   = silu(h W_gate^T) * (h W_up^T), h = rmsnorm(x)    chunks of gate/up panel pairs
 *   x    += act W_down^T (+ b)                                chunks of panels
 * then rmsnorm of the sampled rows and their logits over the (tied or not) LM head's panels.
 *
 * LoRA adapters (Step.lora): the rows that use an adapter get its low-rank delta, (x a^T) b_t,
 * added to each projection it targets (pairs of float32 or bfloat16, summed in float32) —
 * Punica's shrink then expand, folded into the stages above (see "LoRA" below: no stage a
 * layer of its own but the SiLU after the raw gate/up panels, since the gate/up deltas go before
 * the SiLU: such a step computes the raw gate and up (the plain panels Lora.gate_up_raw) instead
 * of the fused SwiGLU panels).
 *
 * The arithmetic is that of the PyTorch modules (models/llama.py) in fp32, in a different order
 * of summation; results are tested against them.
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode_step.h"

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

/* Row r's queries of KV head h (its G query heads, G * D floats at q): q norm (Qwen3) and rotary,
 * in place. */
static void prepare_queries(const Model *md, const Layer *ly, const Step *st, float *q, int64_t r) {
    const int64_t D = md->head_dim, G = md->num_heads / md->num_kv_heads;
    const float *cos = md->cos + st->positions[r] * D, *sin = md->sin + st->positions[r] * D;
    for (int64_t g = 0; g < G; g++, q += D) {
        if (ly->q_norm != NULL) rmsnorm(q, ly->q_norm, D, md->eps, q);
        rotate(q, cos, sin, D);
    }
}

/* Row r's key of KV head h normed (Qwen3) and rotated in place, and its key and value written to
 * the row's slot. */
static void write_kv(const Model *md, const Layer *ly, const Step *st, float *qkv, int64_t ld, int64_t r, int64_t h) {
    const int64_t D = md->head_dim, Hkv = md->num_kv_heads;
    float *row = qkv + r * ld;
    float *k = row + md->num_heads * D + h * D;
    const float *v = row + (md->num_heads + Hkv) * D + h * D;
    const float *cos = md->cos + st->positions[r] * D, *sin = md->sin + st->positions[r] * D;
    if (ly->k_norm != NULL) rmsnorm(k, ly->k_norm, D, md->eps, k);
    rotate(k, cos, sin, D);
    const int64_t at = (st->slots[r] * Hkv + h) * D;
    if (md->kv_dtype == KV_F32) {
        memcpy((float *)ly->k_cache + at, k, sizeof(float) * D);
        memcpy((float *)ly->v_cache + at, v, sizeof(float) * D);
    } else {
        uint16_t *kc = (uint16_t *)ly->k_cache + at, *vc = (uint16_t *)ly->v_cache + at;
        for (int64_t d = 0; d < D; d++) kc[d] = kv_half_of(k[d], md->kv_dtype), vc[d] = kv_half_of(v[d], md->kv_dtype);
    }
}

/* q/k norms, rotary and the K/V writes for row r's KV head h (and its G query heads), in place. */
static void prepare_head(const Model *md, const Layer *ly, const Step *st, float *qkv, int64_t ld, int64_t r, int64_t h) {
    const int64_t G = md->num_heads / md->num_kv_heads;
    prepare_queries(md, ly, st, qkv + r * ld + h * G * md->head_dim, r);
    write_kv(md, ly, st, qkv, ld, r, h);
}

/* A sequence's context is attended in parts of this many positions (attend_part), merged after
 * (merge_parts): a single stream's three KV heads were three items for two threads, one thread
 * doing two while the other waited — attention took ~28 % of a single-stream step at ~230
 * positions. The parts are fixed positions of the context, not a share of the step's rows, so a
 * row's result depends on its context alone (batch invariance) whatever else is in the step. */
enum { ATTEND_PART = 128 };

typedef struct {
    float *x, *norm, *qkv, *attn, *act;
    float *raw; /* [rows, 2 * intermediate]: gate and up before the SiLU (LoRA steps with gate/up deltas) */
    int64_t qkv_ld, norm_ld;
    /* each thread's buffer for a matrix's input rows quantized to int8 (int8_activations), of
     * qrows_bytes(q_rows, q_k) bytes, q_ld apart; NULL when no matrix needs it */
    char *quantized;
    int64_t q_rows, q_k, q_ld;
    AmxScratch *amx; /* each thread's AMX tiles (amx[t].started: in use for 16 rows or more) */
    /* Attention groups: rows first[g] .. first[g] + count[g] - 1 are one sequence's consecutive
     * positions (a verification, or a draft's catch-up), attended together (attend_rows). */
    int64_t *group_first, *group_count, num_groups;
    /* LoRA steps: each row's shrinks (x a^T), xa_ld floats a row, in slots of xa_rank floats
     * (lora_slots); NULL without adapters */
    float *xa;
    int64_t xa_rank, xa_ld;
    /* Attention in parts of a context: row r's part p's output at parts + (r max_parts + p) q_width
     * and its (largest score, sum) per query head at part_stats + (r max_parts + p) 2 num_heads;
     * parts_done[l num_groups + g]: group g's parts finished in layer l */
    float *parts, *part_stats;
    int64_t max_parts;
    float *queries; /* each thread's copy of the queries its attention items read (R rows of num_heads * head_dim) */
    _Atomic int64_t *parts_done;
} Scratch;

/* The parts [*first, *end) of group g's context that layer attention (window: its sliding window,
 * <= 0 none) reads: from the first row's first visible position to the last row's last. */
static void context_parts(const Step *st, const Scratch *sc, int64_t window, int64_t g, int64_t *first, int64_t *end) {
    const int64_t r = sc->group_first[g], len = st->ctx_lens[r + sc->group_count[g] - 1];
    const int64_t start = window > 0 && st->ctx_lens[r] > window ? st->ctx_lens[r] - window : 0;
    *first = start / ATTEND_PART;
    *end = (len + ATTEND_PART - 1) / ATTEND_PART;
}

/* Runs of rows of one sequence at consecutive positions: the same block table, each row one
 * position (and one context row) past the one before. */
static void find_groups(const Step *st, Scratch *sc) {
    sc->num_groups = 0;
    for (int64_t r = 0; r < st->rows; r++) {
        const int64_t g = sc->num_groups - 1;
        const int joins = r > 0 && st->positions[r] == st->positions[r - 1] + 1 && st->ctx_lens[r] == st->ctx_lens[r - 1] + 1 &&
                          !memcmp(st->block_tables + r * st->max_blocks, st->block_tables + (r - 1) * st->max_blocks,
                                  sizeof(int64_t) * st->max_blocks);
        if (joins) {
            sc->group_count[g]++;
        } else {
            sc->group_first[sc->num_groups] = r;
            sc->group_count[sc->num_groups++] = 1;
        }
    }
}

/* One stage's counters, on their own cache line: `claimed` hands out the items of a small stage
 * in order; a matrix stage's chunks are claimed through their flags in `taken`. */
typedef struct {
    _Atomic int64_t claimed, done;
    _Atomic unsigned char *taken;
    char pad[64 - 2 * sizeof(int64_t) - sizeof(void *)];
} Stage;

/* The six of every layer, then LoRA's: silu * up after the raw gate/up panels, and the down deltas
 * of a step whose adapters target down but not gate/up */
enum { STAGES_PER_LAYER = 8, LORA_SILU = 6, LORA_DOWN_STAGE = 7 };
enum { LORA_PROJECTIONS = 7, LORA_COLUMNS = 256, LORA_MAX_RANK = 256 };
enum { LORA_Q = 0, LORA_O = 3, LORA_GATE = 4, LORA_DOWN = 6 };

/* Projection p's (q, k, v, o, gate, up, down) inputs, outputs and first column in its site's
 * output (q|k|v of qkv, gate|up of the raw gate/up rows). */
static void lora_shape(const Model *md, int p, int64_t *k, int64_t *n, int64_t *offset) {
    const int64_t H = md->hidden, q = md->num_heads * md->head_dim, kv = md->num_kv_heads * md->head_dim, I = md->intermediate;
    const int64_t ks[LORA_PROJECTIONS] = {H, H, H, q, H, H, I}, ns[LORA_PROJECTIONS] = {q, kv, kv, H, I, I, H};
    const int64_t offsets[LORA_PROJECTIONS] = {0, q, q + kv, 0, 0, I, 0};
    *k = ks[p], *n = ns[p], *offset = offsets[p];
}
/* Sequences per thread from which an attention item takes all of a sequence's KV heads. */
enum { ATTEND_WHOLE_ROWS = 4 };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t claim(Stage *stage) { return atomic_fetch_add_explicit(&stage->claimed, 1, memory_order_relaxed); }

static inline void finish(Stage *stage) { atomic_fetch_add_explicit(&stage->done, 1, memory_order_release); }

/* Bytes of weights a thread may prefetch while it waits for a stage's last chunks. */
enum { AHEAD_BYTES = 256 * 1024 };

/* The start of the weights a thread streams first in the next matrix stage (its own first
 * chunk, see Walk), and how many bytes of it to prefetch while waiting. */
typedef struct {
    const char *at;
    int64_t bytes;
} Ahead;

/* Until all n chunks of the stage are done: first prefetch `ahead` into L2 (so the memory keeps
 * streaming while this thread has nothing to compute), then a short spin, then yield the core
 * (the thread we wait for may be waiting for it). */
static void await(Stage *stage, int64_t n, Ahead ahead) {
    int64_t off = 0;
    for (int spins = 0; atomic_load_explicit(&stage->done, memory_order_acquire) < n;) {
        if (off < ahead.bytes) {
            for (const int64_t end = off + 1024 < ahead.bytes ? off + 1024 : ahead.bytes; off < end; off += 64)
                __builtin_prefetch(ahead.at + off, 0, 2);
        } else if (spins++ < 2000) {
            cpu_relax();
        } else {
            sched_yield();
        }
    }
}

static const Ahead NOTHING_AHEAD = {NULL, 0};

/* Chunks of a matrix's panels: ~8 per thread, so a slow thread holds back little; at most
 * MAX_CHUNKS_PER_THREAD * nt of them. */
enum { CHUNKS_PER_THREAD = 8, MAX_CHUNKS_PER_THREAD = 2 * CHUNKS_PER_THREAD };
typedef struct {
    int64_t per, n; /* units (panels, or gate/up panel pairs) per chunk; chunks */
} Chunks;

static inline Chunks chunks_of(int64_t units, int nt) {
    int64_t per = units / (CHUNKS_PER_THREAD * nt);
    if (per < 1) per = 1;
    return (Chunks){per, (units + per - 1) / per};
}

static inline int take(Stage *stage, int64_t c) {
    return !atomic_load_explicit(&stage->taken[c], memory_order_relaxed) &&
           !atomic_exchange_explicit(&stage->taken[c], 1, memory_order_relaxed);
}

/* A thread's walk over a matrix stage's n chunks: its own share [n t / nt, n (t + 1) / nt) front
 * to back, then the other threads' shares back to front. A share's chunks are adjacent in memory,
 * so a thread streams one contiguous run of weights (the hardware prefetchers' stream never
 * restarts), and only a thread that runs out of its own work takes another's last chunks. Handing
 * chunks out in order from one counter instead interleaves the threads' reads chunk by chunk, and
 * every chunk starts a new stream (docs/engine.md has the measurement). */
typedef struct {
    int64_t n, lo, hi, i;
    int t, nt, walked;
} Walk;

static Walk walk_start(int64_t n, int t, int nt) {
    Walk w = {n, 0, 0, 0, t, nt, 0};
    thread_share(n, t, nt, &w.lo, &w.hi);
    return w;
}

/* The next chunk this thread claims, or -1 when every chunk is taken. */
static int64_t next_chunk(Stage *stage, Walk *w) {
    for (;;) {
        if (w->i == w->hi - w->lo) {
            if (++w->walked == w->nt) return -1;
            thread_share(w->n, (w->t + w->walked) % w->nt, w->nt, &w->lo, &w->hi);
            w->i = 0;
            continue;
        }
        const int64_t c = w->walked == 0 ? w->lo + w->i : w->hi - 1 - w->i;
        w->i++;
        if (take(stage, c)) return c;
    }
}

/* Where thread t's walk over a matrix stage starts (its own first chunk), as much as a wait
 * may prefetch of it. */
static Ahead ahead_of(const Matrix *w, int paired, int t, int nt) {
    const int64_t units = paired ? w->num_panels / 2 : w->num_panels;
    const int64_t unit_bytes = panel_bytes(w) * (paired ? 2 : 1);
    const Chunks ch = chunks_of(units, nt);
    const Walk walk = walk_start(ch.n, t, nt);
    const int64_t first = walk.lo * ch.per, left = units - first;
    const int64_t bytes = walk.hi > walk.lo ? (left < ch.per ? left : ch.per) * unit_bytes : 0;
    return (Ahead){(const char *)w->panels + first * unit_bytes, bytes < AHEAD_BYTES ? bytes : AHEAD_BYTES};
}

/* The stage's input rows quantized into thread t's buffer, where w takes int8 activations
 * (each thread quantizes the rows itself: no wait for another thread's copy; the rows' codes are
 * the same whichever thread computes them); else NULL. */
static const QRows *quantize_input(const Scratch *sc, const Matrix *w, const float *x, int64_t m, int64_t ldx, int t, QRows *xq) {
    if (!int8_activations(w) || sc->quantized == NULL) return NULL;
    *xq = qrows_padded(sc->quantized + t * sc->q_ld, m, amx_rows_of(m), w->k);
    quantize_rows(x, m, ldx, xq);
    return xq;
}

/* Whether a matmul of m rows takes the AMX tiles (this thread's, started where the step's int8
 * matrices may use them). */
static inline int tiles_for(const AmxScratch *amx, const QRows *xq, int64_t m) {
    return xq != NULL && amx->started && m >= AMX_MIN_ROWS;
}

/* ---- LoRA: Punica's shrink (xa = x a^T, rank sums of a row's inputs) and expand (y += xa b_t),
 * folded into the stages a base step has. A step's stages are its barriers, and at two threads a
 * single stream's extra LoRA stages (five a layer, each a few microseconds of work that one
 * thread did while the other waited) cost more than their arithmetic: 0.72x the base's speed
 * against 0.88-0.97x with one thread. So each shrink is an item of a stage whose inputs are
 * complete anyway, and each expand happens where its output columns are written or read next:
 *   q, k, v   shrink: items of the qkv stage (every thread has the normed rows);
 *             expand: in the (row, KV head) items that rotate those very columns;
 *   o         shrink: partial sums in the attention items (a KV head's query heads' columns);
 *             expand: in the epilogue of the o panels' chunks (the columns a chunk writes);
 *   gate, up  shrink: items of the raw gate/up stage; expand: in the silu items, before the SiLU;
 *   down      shrink: partial sums in the silu items (the act columns they write);
 *             expand: in the epilogue of the down panels' chunks.
 * A LoRA step then has one stage more than a base one (the SiLU after the raw gate/up panels, the
 * deltas being needed before it). */

/* Element i of a pair's matrix as a float: float32 loaded, bfloat16 widened exactly (its bits in
 * a float's upper half). With `bf16` a constant after inlining the loops below vectorise either
 * way (the widening: a zero-extension of 16-bit lanes to 32 and a shift left by 16). */
static inline __attribute__((always_inline)) float pair_at(const void *m, int64_t i, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)m)[i]) : ((const float *)m)[i];
}

/* Row r's pair of projection `proj` in layer l, or NULL (the row is the base model's, or its
 * adapter does not target the projection). */
static inline const LoraPair *row_pair(const Model *md, const Lora *lora, int64_t r, int64_t l, int proj) {
    const int64_t adapter = lora->row_adapter[r];
    if (adapter < 0) return NULL;
    const LoraPair *p = &lora->pairs[(adapter * md->num_layers + l) * LORA_PROJECTIONS + proj];
    return p->a != NULL ? p : NULL;
}

/* A row's shrink slots (Scratch.xa, xa_rank floats each): q, k, v; o's partial sums, one per KV
 * head; gate, up; down's partial sums, one per LORA_COLUMNS columns of act. */
enum { XA_QKV = 0, XA_O = 3 };
static inline int64_t xa_gate(const Model *md) { return XA_O + md->num_kv_heads; }
static inline int64_t down_parts(const Model *md) { return (md->intermediate + LORA_COLUMNS - 1) / LORA_COLUMNS; }
static inline int64_t xa_down(const Model *md) { return xa_gate(md) + 2; }
static inline int64_t lora_slots(const Model *md) { return xa_down(md) + down_parts(md); }
static inline float *xa_of(const Scratch *sc, int64_t r, int64_t slot) { return sc->xa + r * sc->xa_ld + slot * sc->xa_rank; }

/* xa[q] = sum over inputs j0 .. j1 - 1 of xr[j] a[q, j]: the whole shrink, or a part of it. Four
 * rank rows a pass: four independent sums (one sum's chain of dependent adds was the loop's
 * limit) over one read of the inputs. */
static inline __attribute__((always_inline)) void shrink_as(const LoraPair *p, const float *restrict xr, int64_t k, int64_t j0,
                                                            int64_t j1, float *restrict xa, const int bf16) {
    int64_t q = 0;
    for (; q + 4 <= p->rank; q += 4) {
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        const int64_t a0 = q * k, a1 = a0 + k, a2 = a1 + k, a3 = a2 + k;
        for (int64_t j = j0; j < j1; j++) {
            const float x = xr[j];
            s0 += x * pair_at(p->a, a0 + j, bf16), s1 += x * pair_at(p->a, a1 + j, bf16);
            s2 += x * pair_at(p->a, a2 + j, bf16), s3 += x * pair_at(p->a, a3 + j, bf16);
        }
        xa[q] = s0, xa[q + 1] = s1, xa[q + 2] = s2, xa[q + 3] = s3;
    }
    for (; q < p->rank; q++) {
        float sum = 0.0f;
        for (int64_t j = j0; j < j1; j++) sum += xr[j] * pair_at(p->a, q * k + j, bf16);
        xa[q] = sum;
    }
}

static void shrink(const LoraPair *p, const float *xr, int64_t k, int64_t j0, int64_t j1, float *xa) {
    if (p->bf16)
        shrink_as(p, xr, k, j0, j1, xa, 1);
    else
        shrink_as(p, xr, k, j0, j1, xa, 0);
}

/* yr[c] += sum_q xa[q] b_t[q, c] for the pair's output columns c0 .. c1 - 1 (yr: the projection's
 * column 0), four rank rows a pass (the output read and written a quarter as often). */
static inline __attribute__((always_inline)) void expand_as(const LoraPair *p, const float *restrict xa, int64_t n, int64_t c0,
                                                            int64_t c1, float *restrict yr, const int bf16) {
    int64_t q = 0;
    for (; q + 4 <= p->rank; q += 4) {
        const float s0 = xa[q], s1 = xa[q + 1], s2 = xa[q + 2], s3 = xa[q + 3];
        const int64_t b0 = q * n, b1 = b0 + n, b2 = b1 + n, b3 = b2 + n;
        for (int64_t c = c0; c < c1; c++)
            yr[c] += s0 * pair_at(p->b_t, b0 + c, bf16) + s1 * pair_at(p->b_t, b1 + c, bf16) +
                     s2 * pair_at(p->b_t, b2 + c, bf16) + s3 * pair_at(p->b_t, b3 + c, bf16);
    }
    for (; q < p->rank; q++)
        for (int64_t c = c0; c < c1; c++) yr[c] += xa[q] * pair_at(p->b_t, q * n + c, bf16);
}

static void expand(const LoraPair *p, const float *xa, int64_t n, int64_t c0, int64_t c1, float *yr) {
    if (c0 >= c1) return;
    if (p->bf16)
        expand_as(p, xa, n, c0, c1, yr, 1);
    else
        expand_as(p, xa, n, c0, c1, yr, 0);
}

/* A LoRA site inside a matrix stage: `shrinks` items (row, projection first + i % count) whose
 * inputs are x, into slot + i % count, done after the thread's panel chunks; and/or the expand of
 * projection `proj` (its output columns the matrix's) over the columns each chunk writes, from
 * the sum of `parts` partial shrinks at `slot`. */
typedef struct {
    const Model *md;
    const Lora *lora;
    int64_t l;
    int first, count; /* shrink items: projections first .. first + count - 1; count 0: none */
    const float *x;
    int64_t ldx, slot;
    int proj; /* the expand's projection; -1: none */
    int64_t parts;
} LoraSite;

static void site_shrink(const LoraSite *s, const Scratch *sc, int64_t i) {
    const int64_t r = i / s->count;
    const int proj = s->first + (int)(i % s->count);
    const LoraPair *p = row_pair(s->md, s->lora, r, s->l, proj);
    if (p == NULL) return;
    int64_t k, n, offset;
    lora_shape(s->md, proj, &k, &n, &offset);
    shrink(p, s->x + r * s->ldx, k, 0, k, xa_of(sc, r, s->slot + i % s->count));
}

/* The expand of the site's projection for rows 0 .. m - 1 over output columns c0 .. c1 - 1. */
static void site_expand(const LoraSite *s, const Scratch *sc, int64_t m, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    float xa[LORA_MAX_RANK];
    for (int64_t r = 0; r < m; r++) {
        const LoraPair *p = row_pair(s->md, s->lora, r, s->l, s->proj);
        if (p == NULL) continue;
        int64_t k, n, offset;
        lora_shape(s->md, s->proj, &k, &n, &offset);
        const float *part = xa_of(sc, r, s->slot);
        for (int64_t q = 0; q < p->rank; q++) xa[q] = part[q];
        for (int64_t j = 1; j < s->parts; j++)
            for (int64_t q = 0; q < p->rank; q++) xa[q] += part[j * sc->xa_rank + q];
        expand(p, xa, n, c0, c1 < n ? c1 : n, y + r * ldy + offset);
    }
}

static void matmul_stage(Stage *stage, const Scratch *sc, const Matrix *w, const float *x, int64_t m, int64_t ldx, float *y,
                         int64_t ldy, int mode, int pair, Ahead next, int t, int nt, const LoraSite *site) {
    const Chunks ch = chunks_of(w->num_panels, nt);
    Walk walk = walk_start(ch.n, t, nt);
    QRows rows;
    const QRows *xq = NULL;
    for (int64_t c; (c = next_chunk(stage, &walk)) >= 0; finish(stage)) {
        if (xq == NULL) xq = quantize_input(sc, w, x, m, ldx, t, &rows);
        const int64_t hi = (c + 1) * ch.per < w->num_panels ? (c + 1) * ch.per : w->num_panels;
        if (tiles_for(&sc->amx[t], xq, m))
            amx_panels(w, xq, m, y, ldy, c * ch.per, hi, 0, mode, &sc->amx[t]);
        else
            matmul_panels(w, x, xq, m, ldx, y, ldy, c * ch.per, hi, mode, pair);
        if (site != NULL && site->proj >= 0) site_expand(site, sc, m, y, ldy, c * ch.per * VW, hi * VW);
    }
    const int64_t shrinks = site != NULL ? m * site->count : 0;
    for (int64_t i; shrinks > 0 && (i = claim(stage)) < shrinks; finish(stage)) site_shrink(site, sc, i);
    await(stage, ch.n + shrinks, next);
}

static void swiglu_stage(Stage *stage, const Scratch *sc, const Matrix *w, const float *x, int64_t m, int64_t ldx, float *act,
                         int64_t ldact, int pair, Ahead next, int t, int nt) {
    const int64_t pairs = w->num_panels / 2;
    const Chunks ch = chunks_of(pairs, nt);
    Walk walk = walk_start(ch.n, t, nt);
    QRows rows;
    const QRows *xq = NULL;
    for (int64_t c; (c = next_chunk(stage, &walk)) >= 0; finish(stage)) {
        if (xq == NULL) xq = quantize_input(sc, w, x, m, ldx, t, &rows);
        const int64_t hi = (c + 1) * ch.per < pairs ? (c + 1) * ch.per : pairs;
        if (tiles_for(&sc->amx[t], xq, m))
            amx_panels(w, xq, m, act, ldact, c * ch.per, hi, 1, STORE, &sc->amx[t]);
        else
            swiglu_panels(w, x, xq, m, ldx, act, ldact, c * ch.per, hi, pair);
    }
    await(stage, ch.n, next);
}

/* Row r's q, k and v deltas for KV head h's columns (its G query heads, its K and V head), added
 * in the item that rotates them and writes K/V: the qkv stage's shrinks are done by then. */
static void qkv_delta(const Model *md, const Lora *lora, const Scratch *sc, int64_t l, int64_t r, int64_t h) {
    const int64_t D = md->head_dim, G = md->num_heads / md->num_kv_heads;
    const int64_t cols[3][2] = {{h * G * D, (h + 1) * G * D}, {h * D, (h + 1) * D}, {h * D, (h + 1) * D}};
    for (int proj = LORA_Q; proj < LORA_Q + 3; proj++) {
        const LoraPair *p = row_pair(md, lora, r, l, proj);
        if (p == NULL) continue;
        int64_t k, n, offset;
        lora_shape(md, proj, &k, &n, &offset);
        expand(p, xa_of(sc, r, XA_QKV + proj - LORA_Q), n, cols[proj - LORA_Q][0], cols[proj - LORA_Q][1],
               sc->qkv + r * sc->qkv_ld + offset);
    }
}

/* Row r's partial o shrinks over KV heads h0 .. h1 - 1's columns of its attention output, one
 * slot per KV head (summed by the o panels' expand). */
static void o_partials(const Model *md, const Lora *lora, const Scratch *sc, int64_t l, int64_t r, int64_t h0, int64_t h1) {
    const LoraPair *p = row_pair(md, lora, r, l, LORA_O);
    if (p == NULL) return;
    const int64_t width = md->num_heads * md->head_dim, per_head = width / md->num_kv_heads;
    for (int64_t h = h0; h < h1; h++) shrink(p, sc->attn + r * width, width, h * per_head, (h + 1) * per_head, xa_of(sc, r, XA_O + h));
}

/* y[r] += (x[r] a^T) b_t for the rows using an adapter, for pair `proj` of layer l, a row an item:
 * the down deltas of a step whose adapters target down but not gate/up (no silu items to hold
 * the partial shrinks). */
static void lora_stage(Stage *stage, const Model *md, const Lora *lora, const Scratch *sc, int64_t l, int proj, const float *x,
                       int64_t ldx, float *y, int64_t ldy, int64_t R, Ahead next) {
    for (int64_t r; (r = claim(stage)) < R; finish(stage)) {
        const LoraPair *p = row_pair(md, lora, r, l, proj);
        if (p == NULL) continue;
        int64_t k, n, offset;
        lora_shape(md, proj, &k, &n, &offset);
        float *xa = xa_of(sc, r, xa_down(md));
        shrink(p, x + r * ldx, k, 0, k, xa);
        expand(p, xa, n, 0, n, y + r * ldy + offset);
    }
    await(stage, R, next);
}

/* act = silu(gate) * up from the raw gate/up rows (LoRA steps), a row's channels LORA_COLUMNS at a
 * time: first the gate and up deltas of those channels (the raw stage's shrinks are done), then
 * the SiLU, then the down projection's partial shrink over the act channels just written. The
 * sigmoid from exp(-|g|) (kernels.h's exp_nonpositive, as the SwiGLU panels compute it): a loop
 * the compiler vectorises, where libm's expf was a scalar call per channel. */
static void silu_stage(Stage *stage, const Model *md, const Lora *lora, const Scratch *sc, int64_t l, int64_t R, Ahead next) {
    const int64_t I = md->intermediate, per_row = down_parts(md), items = R * per_row;
    for (int64_t i; (i = claim(stage)) < items; finish(stage)) {
        const int64_t r = i / per_row, c0 = i % per_row * LORA_COLUMNS, c1 = c0 + LORA_COLUMNS < I ? c0 + LORA_COLUMNS : I;
        float *restrict gate = sc->raw + r * 2 * I, *restrict up = gate + I;
        for (int proj = LORA_GATE; proj < LORA_GATE + 2; proj++) {
            const LoraPair *p = row_pair(md, lora, r, l, proj);
            if (p != NULL) expand(p, xa_of(sc, r, xa_gate(md) + proj - LORA_GATE), I, c0, c1, proj == LORA_GATE ? gate : up);
        }
        float *restrict out = sc->act + r * I;
        for (int64_t c = c0; c < c1; c++) {
            const float g = gate[c], e = exp_nonpositive(g < 0.0f ? g : -g);
            out[c] = g * (g < 0.0f ? e : 1.0f) / (1.0f + e) * up[c];
        }
        const LoraPair *down = row_pair(md, lora, r, l, LORA_DOWN);
        if (down != NULL) shrink(down, out, I, c0, c1, xa_of(sc, r, xa_down(md) + i % per_row));
    }
    await(stage, items, next);
}

/* One layer, run by every thread of the region; `next` is the matrix that follows the layer (the
 * next layer's qkv, or the LM head). KERNEL_OK, or KERNEL_NO_MEMORY if attention ran out of memory. */
static int layer_step(const Model *md, const Layer *ly, const Matrix *next, const Step *st, const Scratch *sc, Stage *stages,
                      int pair, int t, int nt) {
    const int64_t R = st->rows, H = md->hidden, D = md->head_dim, Hkv = md->num_kv_heads, G = md->num_heads / Hkv;
    const int64_t q_width = md->num_heads * D;
    const Shape shape = {md->block_size, Hkv, md->num_heads / Hkv, D, (int)md->kv_dtype};
    float *norm = sc->norm + t * sc->norm_ld;
    int failed = 0;

    for (int64_t r = 0; r < R; r++) rmsnorm(sc->x + r * H, ly->input_norm, H, md->eps, norm + r * H);
    const Ahead o_ahead = ahead_of(&ly->o, 0, t, nt);
    const Lora *lora = st->lora;
    const int64_t l = ly - md->layers, I = md->intermediate;
    const LoraSite qkv_site = {md, lora, l, LORA_Q, 3, norm, H, XA_QKV, -1, 0};
    matmul_stage(&stages[0], sc, &ly->qkv, norm, R, H, sc->qkv, sc->qkv_ld, STORE, pair, o_ahead, t, nt,
                 lora != NULL ? &qkv_site : NULL);
    /* A step of one sequence without adapters: its attention items prepare what they read
     * themselves — each its own copy of the rows' queries (several parts read them), and the keys
     * and values of the rows whose positions lie in its part (the part that reads them) — with no
     * stage of their own. Otherwise the rotary stage runs first: with several groups, rows of one
     * sequence may form more than one (a draft's catch-up rows) and read each other's keys, and
     * with adapters the q/k/v deltas go in before the rotation. */
    const int own = lora == NULL && sc->num_groups == 1;
    for (int64_t i; !own && (i = claim(&stages[1])) < R * Hkv; finish(&stages[1])) {
        if (lora != NULL) qkv_delta(md, lora, sc, l, i / Hkv, i % Hkv);
        prepare_head(md, ly, st, sc->qkv, sc->qkv_ld, i / Hkv, i % Hkv);
    }
    if (!own) await(&stages[1], R * Hkv, o_ahead);
    float *queries = sc->queries + t * R * q_width;
    /* An item is a part of a sequence's context for its KV heads `per` at a time: one at a time
     * while there are few sequences, so the threads share the work evenly; all of them once there
     * are many, or for a single sequence whose context has a part for every thread, so a K/V row
     * (every KV head's side by side) is read whole by one item, not a head's 256 bytes of it by
     * each of three (at ~40 sequences attention took 45 % of the step; a single stream at 129-328
     * positions took 7.6 % less a step than with a head an item) */
    int64_t start[sc->num_groups + 1], first_part[sc->num_groups], num_parts[sc->num_groups];
    for (int64_t g = 0; g < sc->num_groups; g++) {
        context_parts(st, sc, ly->window, g, &first_part[g], &num_parts[g]);
        num_parts[g] -= first_part[g];
    }
    const int64_t per = sc->num_groups >= ATTEND_WHOLE_ROWS * nt || (sc->num_groups == 1 && num_parts[0] >= nt) ? Hkv : 1,
                  sets = Hkv / per;
    start[0] = 0;
    for (int64_t g = 0; g < sc->num_groups; g++) start[g + 1] = start[g] + sets * num_parts[g];
    const int64_t items = start[sc->num_groups];
    for (int64_t i, g = 0; (i = claim(&stages[2])) < items; finish(&stages[2])) {
        while (i >= start[g + 1]) g++; /* items are claimed in ascending order */
        const int64_t parts = num_parts[g], part = (i - start[g]) / sets, h = (i - start[g]) % sets * per;
        const int64_t r = sc->group_first[g], rows = sc->group_count[g];
        const int64_t p0 = (first_part[g] + part) * ATTEND_PART, p1 = parts == 1 ? INT64_MAX : p0 + ATTEND_PART;
        const float *q = sc->qkv + r * sc->qkv_ld;
        int64_t q_stride = sc->qkv_ld;
        if (own) {
            for (int64_t j = 0; j < rows; j++)
                for (int64_t head = h; head < h + per; head++) {
                    float *mine = queries + j * q_width + head * G * D;
                    memcpy(mine, sc->qkv + (r + j) * sc->qkv_ld + head * G * D, sizeof(float) * G * D);
                    prepare_queries(md, ly, st, mine, r + j);
                    if (st->positions[r + j] >= p0 && st->positions[r + j] < p1) write_kv(md, ly, st, sc->qkv, sc->qkv_ld, r + j, head);
                }
            q = queries, q_stride = q_width;
        }
        const int64_t *table = st->block_tables + r * st->max_blocks;
        if (parts == 1) {
            failed = worse_status(failed, attend_rows(q, q_stride, rows, st->ctx_lens + r, ly->k_cache, ly->v_cache, table,
                                                      ly->window, md->attn_scale, shape, h, h + per, sc->attn + r * q_width,
                                                      q_width));
            for (int64_t j = 0; lora != NULL && j < rows; j++) o_partials(md, lora, sc, l, r + j, h, h + per);
            continue;
        }
        const int64_t slot = r * sc->max_parts + part;
        failed = worse_status(failed, attend_part(q, q_stride, rows, st->ctx_lens + r, ly->k_cache, ly->v_cache, table,
                                                  ly->window, md->attn_scale, shape, h, h + per, sc->parts + slot * q_width,
                                                  sc->max_parts * q_width, p0, p0 + ATTEND_PART, sc->part_stats + slot * 2 * md->num_heads,
                                                  sc->max_parts * 2 * md->num_heads));
        /* the group's last part to finish merges them (its writes are complete: release/acquire) */
        if (atomic_fetch_add_explicit(&sc->parts_done[l * sc->num_groups + g], 1, memory_order_acq_rel) == parts * sets - 1)
            for (int64_t j = r; j < r + rows; j++) {
                merge_parts(sc->parts + j * sc->max_parts * q_width, sc->part_stats + j * sc->max_parts * 2 * md->num_heads, parts,
                            md->num_heads, D, sc->attn + j * q_width);
                if (lora != NULL) o_partials(md, lora, sc, l, j, 0, Hkv);
            }
    }
    await(&stages[2], items, o_ahead);
    /* a LoRA step with gate/up deltas reads the raw gate/up panels: those are what to read ahead */
    const int raw = lora != NULL && lora->gate_up_raw != NULL;
    const Ahead up_ahead = raw ? ahead_of(&lora->gate_up_raw[l], 0, t, nt) : ahead_of(&ly->gate_up, 1, t, nt);
    const Ahead down_ahead = ahead_of(&ly->down, 0, t, nt), next_ahead = ahead_of(next, 0, t, nt);
    const LoraSite o_site = {md, lora, l, 0, 0, NULL, 0, XA_O, LORA_O, Hkv};
    matmul_stage(&stages[3], sc, &ly->o, sc->attn, R, q_width, sc->x, H, ACCUMULATE, pair, up_ahead, t, nt,
                 lora != NULL ? &o_site : NULL);
    for (int64_t r = 0; r < R; r++) rmsnorm(sc->x + r * H, ly->post_norm, H, md->eps, norm + r * H);
    if (raw) {
        const LoraSite gate_up_site = {md, lora, l, LORA_GATE, 2, norm, H, xa_gate(md), -1, 0};
        matmul_stage(&stages[4], sc, &lora->gate_up_raw[l], norm, R, H, sc->raw, 2 * I, STORE, pair, down_ahead, t, nt,
                     &gate_up_site);
        silu_stage(&stages[LORA_SILU], md, lora, sc, l, R, down_ahead);
    } else {
        swiglu_stage(&stages[4], sc, &ly->gate_up, norm, R, H, sc->act, I, pair, down_ahead, t, nt);
    }
    /* the down deltas: from the silu items' partial shrinks, or (no raw gate/up) a stage of their own */
    const LoraSite down_site = {md, lora, l, 0, 0, NULL, 0, xa_down(md), LORA_DOWN, down_parts(md)};
    matmul_stage(&stages[5], sc, &ly->down, sc->act, R, I, sc->x, H, ACCUMULATE, pair, next_ahead, t, nt, raw ? &down_site : NULL);
    if (lora != NULL && !raw) lora_stage(&stages[LORA_DOWN_STAGE], md, lora, sc, l, LORA_DOWN, sc->act, I, sc->x, H, R, next_ahead);
    return failed;
}

/* Bytes of the weights a step streams: every layer's matrices and the LM head. */
static int64_t model_bytes(const Model *md) {
    int64_t bytes = matrix_bytes(md->lm_head);
    for (int64_t l = 0; l < md->num_layers; l++) {
        const Layer *ly = &md->layers[l];
        bytes += matrix_bytes(&ly->qkv) + matrix_bytes(&ly->o) + matrix_bytes(&ly->gate_up) + matrix_bytes(&ly->down);
    }
    return bytes;
}

/* A matrix of the model: within its buffers, and [n, k] as the model's sizes say. */
static int check_shape(const Matrix *w, int64_t n, int64_t k, const char *name, int64_t layer) {
    char label[64];
    snprintf(label, sizeof label, "decode step: layer %lld %s", (long long)layer, name);
    const int status = check_matrix(w, label);
    if (status) return status;
    REQUIRE(w->n == n && w->k == k, "%s is [%lld, %lld], the model needs [%lld, %lld]", label, (long long)w->n, (long long)w->k,
            (long long)n, (long long)k);
    return KERNEL_OK;
}

int check_model(const Model *md) {
    const int64_t H = md->hidden, D = md->head_dim;
    REQUIRE(md->num_layers >= 0 && H > 0 && md->num_kv_heads > 0 && md->vocab > 0 && md->embed_rows > 0 && md->intermediate > 0 &&
                md->block_size > 0 && md->num_blocks > 0 && md->max_position > 0,
            "decode step: a model with %lld layers, hidden %lld, %lld KV heads, vocab %lld, %lld blocks of %lld",
            (long long)md->num_layers, (long long)H, (long long)md->num_kv_heads, (long long)md->vocab,
            (long long)md->num_blocks, (long long)md->block_size);
    REQUIRE(md->kv_dtype == KV_F32 || md->kv_dtype == KV_BF16 || md->kv_dtype == KV_F16,
            "decode step: kv_dtype is %lld, not 0 (float32), 1 (bfloat16) or 2 (float16)", (long long)md->kv_dtype);
    int status = check_shape(md->lm_head, md->vocab, H, "LM head", md->num_layers);
    for (int64_t l = 0; l < md->num_layers && !status; l++) {
        const Layer *ly = &md->layers[l];
        if (!status) status = check_shape(&ly->qkv, (md->num_heads + 2 * md->num_kv_heads) * D, H, "qkv", l);
        if (!status) status = check_shape(&ly->o, H, md->num_heads * D, "o", l);
        if (!status) status = check_shape(&ly->gate_up, 2 * md->intermediate, H, "gate/up", l);
        if (!status) status = check_shape(&ly->down, H, md->intermediate, "down", l);
        if (!status && ly->gate_up.num_panels % 2) status = refuse("decode step: layer %lld gate/up has an odd panel count", (long long)l);
    }
    return status;
}

/* A step's adapters: every row's index among them, every pair's rank within the stack buffer,
 * and raw gate/up panels of each layer's shape where an adapter targets gate/up. */
static int check_lora(const Model *md, const Step *st) {
    const Lora *lora = st->lora;
    if (lora == NULL) return KERNEL_OK;
    REQUIRE(lora->num_adapters >= 1 && lora->row_adapter != NULL && lora->pairs != NULL, "decode step: %lld LoRA adapters",
            (long long)lora->num_adapters);
    for (int64_t r = 0; r < st->rows; r++)
        REQUIRE(lora->row_adapter[r] >= -1 && lora->row_adapter[r] < lora->num_adapters,
                "decode step: row %lld uses LoRA adapter %lld of %lld", (long long)r, (long long)lora->row_adapter[r],
                (long long)lora->num_adapters);
    for (int64_t i = 0; i < lora->num_adapters * md->num_layers * LORA_PROJECTIONS; i++) {
        const LoraPair *p = &lora->pairs[i];
        const int proj = (int)(i % LORA_PROJECTIONS);
        int64_t k, n, offset;
        lora_shape(md, proj, &k, &n, &offset);
        REQUIRE(p->a == NULL || (p->b_t != NULL && p->rank >= 1 && p->rank <= LORA_MAX_RANK),
                "decode step: LoRA pair %lld has rank %lld (at most %d)", (long long)i, (long long)p->rank, LORA_MAX_RANK);
        REQUIRE(p->a == NULL || p->bf16 == 0 || p->bf16 == 1, "decode step: LoRA pair %lld has bf16 %lld, not 0 or 1",
                (long long)i, (long long)p->bf16);
        REQUIRE(p->a == NULL || (k * p->rank <= p->a_capacity && p->rank * n <= p->b_capacity),
                "decode step: LoRA pair %lld of rank %lld needs [r, %lld] and [r, %lld] elements, it has %lld and %lld",
                (long long)i, (long long)p->rank, (long long)k, (long long)n, (long long)p->a_capacity, (long long)p->b_capacity);
        REQUIRE(p->a == NULL || (proj != LORA_GATE && proj != LORA_GATE + 1) || lora->gate_up_raw != NULL,
                "decode step: LoRA pair %lld targets gate/up without the raw gate/up panels", (long long)i);
    }
    for (int64_t l = 0; lora->gate_up_raw != NULL && l < md->num_layers; l++) {
        const int status = check_shape(&lora->gate_up_raw[l], 2 * md->intermediate, md->hidden, "raw gate_up", l);
        if (status) return status;
    }
    return KERNEL_OK;
}

int check_step(const Model *md, const Step *st, int64_t extra) {
    const int64_t R = st->rows, bs = md->block_size;
    REQUIRE(R >= 1 && st->num_logits >= 0 && st->max_blocks >= 0 && extra >= 0, "decode step: %lld rows, %lld logit rows",
            (long long)R, (long long)st->num_logits);
    REQUIRE(st->num_logits <= st->logits_capacity / md->vocab, "decode step: %lld logit rows of %lld do not fit %lld floats",
            (long long)st->num_logits, (long long)md->vocab, (long long)st->logits_capacity);
    for (int64_t i = 0; i < st->num_logits; i++)
        REQUIRE(st->logit_rows[i] >= 0 && st->logit_rows[i] < R, "decode step: logit row %lld is row %lld of a %lld-row step",
                (long long)i, (long long)st->logit_rows[i], (long long)R);
    for (int64_t r = 0; r < R; r++) {
        REQUIRE(st->token_ids[r] >= 0 && st->token_ids[r] < md->embed_rows,
                "decode step: row %lld has token %lld, the embedding has %lld rows", (long long)r, (long long)st->token_ids[r],
                (long long)md->embed_rows);
        REQUIRE(st->positions[r] >= 0 && st->positions[r] + extra < md->max_position,
                "decode step: row %lld at position %lld (+%lld), the rotary tables have %lld", (long long)r,
                (long long)st->positions[r], (long long)extra, (long long)md->max_position);
        REQUIRE(st->slots[r] >= 0 && st->slots[r] < md->num_blocks * bs, "decode step: row %lld writes slot %lld of %lld",
                (long long)r, (long long)st->slots[r], (long long)(md->num_blocks * bs));
        REQUIRE(st->ctx_lens[r] >= 1, "decode step: row %lld has context length %lld", (long long)r, (long long)st->ctx_lens[r]);
        const int status = check_table(st->block_tables + r * st->max_blocks, st->max_blocks, st->ctx_lens[r] + extra, bs,
                                       md->num_blocks, "decode step: row", r);
        if (status) return status;
    }
    return check_lora(md, st);
}

/* The highest rank of the step's pairs (the stride of a row's shrink slots; checked <= LORA_MAX_RANK). */
static int64_t lora_max_rank(const Model *md, const Lora *lora) {
    int64_t rank = 1;
    for (int64_t i = 0; lora != NULL && i < lora->num_adapters * md->num_layers * LORA_PROJECTIONS; i++)
        if (lora->pairs[i].a != NULL && lora->pairs[i].rank > rank) rank = lora->pairs[i].rank;
    return rank;
}

int decode_step(const Model *md, const Step *st, int num_threads) {
    const int64_t R = st->rows, H = md->hidden, D = md->head_dim;
    if (md->num_heads <= 0 || md->num_kv_heads <= 0 || D <= 0 || D % 8 != 0 || md->num_heads % md->num_kv_heads != 0)
        return KERNEL_BAD_SHAPE;
    REQUIRE(num_threads >= 1, "decode step: %d threads", num_threads);
    int status = check_model(md);
    if (!status) status = check_step(md, st, 0);
    if (status) return status;
    Scratch sc;
    sc.qkv_ld = (md->num_heads + 2 * md->num_kv_heads) * D;
    /* each thread's copy of a norm: of the step's rows in a layer, of the logit rows at the end
     * (more than the rows where several samples of one prompt position each take its logits) */
    sc.norm_ld = (st->num_logits > R ? st->num_logits : R) * H;
    const int64_t raw_floats = st->lora != NULL && st->lora->gate_up_raw != NULL ? R * 2 * md->intermediate : 0;
    sc.xa_rank = lora_max_rank(md, st->lora);
    sc.xa_ld = st->lora != NULL ? lora_slots(md) * sc.xa_rank : 0;
    sc.max_parts = 1;
    for (int64_t r = 0; r < R; r++) {
        const int64_t parts = (st->ctx_lens[r] + ATTEND_PART - 1) / ATTEND_PART;
        sc.max_parts = parts > sc.max_parts ? parts : sc.max_parts;
    }
    const int64_t part_floats = R * sc.max_parts * (md->num_heads * D + 2 * md->num_heads) + num_threads * R * md->num_heads * D;
    const int64_t floats = R * H + num_threads * sc.norm_ld + R * sc.qkv_ld + R * md->num_heads * D + R * md->intermediate +
                           raw_floats + R * sc.xa_ld + part_floats;
    float *scratch = malloc(sizeof(float) * floats);
    sc.parts_done = calloc(md->num_layers * R, sizeof(*sc.parts_done));
    const int64_t num_stages = md->num_layers * STAGES_PER_LAYER + 1, max_chunks = MAX_CHUNKS_PER_THREAD * num_threads;
    Stage *stages = calloc(num_stages, sizeof(Stage));
    _Atomic unsigned char *taken = calloc(num_stages * max_chunks, 1);
    int64_t *groups = malloc(sizeof(int64_t) * 2 * R);
    /* int8 activations: a buffer per thread for the widest input of the rows of any matrix */
    int any_int8 = int8_activations(md->lm_head);
    for (int64_t l = 0; l < md->num_layers; l++) {
        const Layer *ly = &md->layers[l];
        any_int8 |= int8_activations(&ly->qkv) | int8_activations(&ly->o) | int8_activations(&ly->gate_up) |
                    int8_activations(&ly->down);
    }
    sc.quantized = NULL;
    sc.q_rows = amx_rows_of(st->num_logits > R ? st->num_logits : R);
    sc.q_k = H > md->num_heads * D ? H : md->num_heads * D;
    sc.q_k = sc.q_k > md->intermediate ? sc.q_k : md->intermediate;
    sc.q_k = (sc.q_k + QBLOCK - 1) / QBLOCK * QBLOCK;
    sc.q_ld = (qrows_bytes(sc.q_rows, sc.q_k) + 63) / 64 * 64;
    int no_memory = 0;
    if (any_int8) no_memory = (sc.quantized = malloc(num_threads * sc.q_ld)) == NULL;
    const int tiles = any_int8 && sc.q_rows >= AMX_MIN_ROWS && amx_usable();
    sc.amx = calloc(num_threads, sizeof(AmxScratch));
    if (scratch == NULL || stages == NULL || taken == NULL || groups == NULL || no_memory || sc.amx == NULL ||
        sc.parts_done == NULL) {
        free((void *)sc.parts_done);
        free(sc.amx);
        free(sc.quantized);
        free(scratch);
        free(stages);
        free((void *)taken);
        free(groups);
        return KERNEL_NO_MEMORY;
    }
    sc.group_first = groups, sc.group_count = groups + R;
    find_groups(st, &sc);
    for (int64_t i = 0; i < num_stages; i++) stages[i].taken = taken + i * max_chunks;
    sc.x = scratch;
    sc.norm = sc.x + R * H;
    sc.qkv = sc.norm + num_threads * sc.norm_ld;
    sc.attn = sc.qkv + R * sc.qkv_ld;
    sc.act = sc.attn + R * md->num_heads * D;
    sc.raw = sc.act + R * md->intermediate;
    sc.xa = st->lora != NULL ? sc.raw + raw_floats : NULL;
    sc.parts = sc.raw + raw_floats + R * sc.xa_ld;
    sc.part_stats = sc.parts + R * sc.max_parts * md->num_heads * D;
    sc.queries = sc.part_stats + R * sc.max_parts * 2 * md->num_heads;
    for (int64_t r = 0; r < R; r++) memcpy(sc.x + r * H, md->embed + st->token_ids[r] * H, sizeof(float) * H);
    const int pair = fits_in_cache(model_bytes(md));

    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(max : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (tiles) amx_start(&sc.amx[t], sc.q_k);
        for (int64_t l = 0; l < md->num_layers; l++) {
            const Matrix *next = l + 1 < md->num_layers ? &md->layers[l + 1].qkv : md->lm_head;
            const int status = layer_step(md, &md->layers[l], next, st, &sc, stages + l * STAGES_PER_LAYER, pair, t, nt);
            failed = worse_status(failed, status);
        }
        float *norm = sc.norm + t * sc.norm_ld;
        for (int64_t i = 0; i < st->num_logits; i++) rmsnorm(sc.x + st->logit_rows[i] * H, md->final_norm, H, md->eps, norm + i * H);
        matmul_stage(&stages[md->num_layers * STAGES_PER_LAYER], &sc, md->lm_head, norm, st->num_logits, H, st->logits, md->vocab,
                     STORE, pair, NOTHING_AHEAD, t, nt, NULL);
        amx_stop(&sc.amx[t]);
    }
    free((void *)sc.parts_done);
    free(sc.amx);
    free(sc.quantized);
    free(groups);
    free((void *)taken);
    free(stages);
    free(scratch);
    return failed;
}

/* Row i's rule in `draws`. */
static inline RowDraw draw_of(const Draws *draws, int64_t i) {
    return row_draw(draws->inv_temperature, draws->temperature, draws->min_p, draws->top_k, draws->top_p, i);
}

/* Refuses draws outside their buffer or the sampler's ranges (check_row_draw; a temperature's
 * inverse 0: the row's argmax), every uniform number of a sampling row in [0, 1); *filters: whether
 * any row filters its logits (and needs draw_row's scratch). */
static int check_draws(const Draws *draws, int64_t rows, int64_t num_steps, int64_t vocab, int *filters) {
    REQUIRE(num_steps * rows <= draws->uniform_capacity, "fused decode steps: %lld steps of %lld rows draw from %lld numbers",
            (long long)num_steps, (long long)rows, (long long)draws->uniform_capacity);
    *filters = 0;
    for (int64_t i = 0; i < rows; i++) {
        const float inverse = draws->inv_temperature[i];
        REQUIRE(inverse >= 0.0f && isfinite(inverse), "fused decode steps: row %lld at 1 / temperature %g", (long long)i,
                (double)inverse);
        if (inverse == 0.0f) continue;
        const RowDraw d = draw_of(draws, i);
        const int status = check_row_draw(d, vocab, "fused decode steps: row", i);
        if (status) return status;
        *filters |= draw_filters(d, vocab);
        for (int64_t s = 0; s < num_steps; s++)
            REQUIRE(draws->uniform[s * rows + i] >= 0.0 && draws->uniform[s * rows + i] < 1.0,
                    "fused decode steps: row %lld's uniform number %g at step %lld, outside [0, 1)", (long long)i,
                    draws->uniform[s * rows + i], (long long)s);
    }
    return KERNEL_OK;
}

/* The most threads any of the steps runs on. */
static int most_threads(const int *threads, int64_t num_steps) {
    int most = 1;
    for (int64_t s = 0; s < num_steps; s++) most = threads[s] > most ? threads[s] : most;
    return most;
}

/* `num_steps` decode steps of the same rows, each row's token fed back as its next input
 * (multi-step scheduling): its argmax, or where `draws` gives the row a temperature a draw by
 * inverse transform sampling of its uniform number for the step, top-k and top-p included
 * (categorical.c's draw_row: the sampler's rule); tokens and logprobs are [num_steps, rows] in
 * logit-row order; step s runs on threads[s] threads and its time is written to seconds[s] (the
 * thread count is tuned per step). Every row
 * samples (num_logits == rows, logit_rows a permutation), and each row's block table must
 * already cover its last position, position + num_steps - 1. Why here rather than one Python
 * step per token: between two steps the engine's per-step Python runs on caches the step's
 * weight stream has just flushed, a cost of the order of a tenth of a single-stream step; this
 * loop pays it once per `num_steps` tokens. The caller's arrays are not changed (the loop
 * advances copies). */
int decode_steps(const Model *md, const Step *st, int64_t num_steps, const int *threads, double *seconds, const Draws *draws,
                 int64_t *tokens, float *logprobs, int64_t out_capacity) {
    const int64_t R = st->rows, bs = md->block_size;
    REQUIRE(num_steps >= 1 && st->num_logits == R && num_steps * R <= out_capacity,
            "fused greedy steps: %lld steps of %lld rows (%lld sampling) into %lld tokens; every row must sample",
            (long long)num_steps, (long long)R, (long long)st->num_logits, (long long)out_capacity);
    int filters = 0;
    int status = check_step(md, st, num_steps - 1);
    if (!status && draws != NULL) status = check_draws(draws, R, num_steps, md->vocab, &filters);
    if (status) return status;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < i; j++)
            REQUIRE(st->logit_rows[i] != st->logit_rows[j], "fused greedy steps: row %lld samples twice",
                    (long long)st->logit_rows[i]);
    int64_t *state = malloc(sizeof(int64_t) * 4 * R);
    /* a filtered draw's scratch, one per thread */
    const size_t scratch_floats = (size_t)DRAW_SCRATCH * (size_t)md->vocab;
    float *scratch = filters ? malloc(sizeof(float) * scratch_floats * (size_t)most_threads(threads, num_steps)) : NULL;
    if (state == NULL || (filters && scratch == NULL)) {
        free(state);
        free(scratch);
        return KERNEL_NO_MEMORY;
    }
    int64_t *ids = state, *pos = state + R, *slots = state + 2 * R, *lens = state + 3 * R;
    memcpy(ids, st->token_ids, sizeof(int64_t) * R);
    memcpy(pos, st->positions, sizeof(int64_t) * R);
    memcpy(slots, st->slots, sizeof(int64_t) * R);
    memcpy(lens, st->ctx_lens, sizeof(int64_t) * R);
    Step step = *st;
    step.token_ids = ids, step.positions = pos, step.slots = slots, step.ctx_lens = lens;
    int failed = 0;
    for (int64_t s = 0; s < num_steps && !failed; s++) {
        const double start = omp_get_wtime();
        failed = decode_step(md, &step, threads[s]);
        seconds[s] = omp_get_wtime() - start;
        if (failed) break;
        /* each row by one thread (its result does not depend on the others), as greedy_rows shares them */
#pragma omp parallel for schedule(static) num_threads(threads[s]) if (R > 1)
        for (int64_t i = 0; i < R; i++) {
            const float *x = st->logits + i * md->vocab;
            const int64_t at = s * R + i;
            if (draws != NULL && draws->inv_temperature[i] > 0.0f) {
                float *mine = scratch == NULL ? NULL : scratch + scratch_floats * (size_t)omp_get_thread_num();
                tokens[at] = draw_row(x, md->vocab, draw_of(draws, i), draws->uniform[at], mine);
                logprobs[at] = token_logprob(x, md->vocab, tokens[at]);
            } else {
                argmax_rows(x, 1, md->vocab, tokens + at, logprobs + at);
            }
        }
        for (int64_t i = 0; i < R && s + 1 < num_steps; i++) {
            const int64_t r = st->logit_rows[i], p = ++pos[r];
            ids[r] = tokens[s * R + i];
            lens[r]++;
            slots[r] = slot_of(st->block_tables + r * st->max_blocks, p, bs);
        }
    }
    free(state);
    free(scratch);
    return failed;
}

/* Refuses what lies outside lora_delta's buffers: the sizes, every pair's rank and capacity, the
 * rows' adapter indices. */
static int check_lora_delta(const Lora *lora, int64_t num_layers, int64_t layer, int64_t first, int64_t count,
                            const int64_t *shapes, int64_t m, int64_t ldx, int64_t x_capacity, int64_t ldy, int64_t y_capacity,
                            int num_threads) {
    REQUIRE(lora != NULL && num_threads >= 1 && m >= 0 && num_layers >= 1 && layer >= 0 && layer < num_layers && first >= 0 &&
                count >= 1 && first + count <= LORA_PROJECTIONS && lora->num_adapters >= 1,
            "LoRA delta: %lld rows, layer %lld of %lld, projections %lld + %lld, %d threads", (long long)m, (long long)layer,
            (long long)num_layers, (long long)first, (long long)count, num_threads);
    for (int64_t j = 0; j < count; j++) {
        const int64_t k = shapes[3 * j], n = shapes[3 * j + 1], offset = shapes[3 * j + 2];
        REQUIRE(k >= 1 && n >= 1 && offset >= 0 && k <= ldx && offset + n <= ldy &&
                    (m == 0 || ((m - 1) * ldx + k <= x_capacity && (m - 1) * ldy + offset + n <= y_capacity)),
                "LoRA delta: projection %lld maps %lld -> %lld at column %lld of rows %lld and %lld apart, in %lld and %lld floats",
                (long long)j, (long long)k, (long long)n, (long long)offset, (long long)ldx, (long long)ldy,
                (long long)x_capacity, (long long)y_capacity);
        for (int64_t g = 0; g < lora->num_adapters; g++) {
            const LoraPair *p = &lora->pairs[(g * num_layers + layer) * LORA_PROJECTIONS + first + j];
            REQUIRE(p->a == NULL || (p->b_t != NULL && p->rank >= 1 && p->rank <= LORA_MAX_RANK && k * p->rank <= p->a_capacity &&
                                     p->rank * n <= p->b_capacity),
                    "LoRA delta: adapter %lld's pair of rank %lld needs [r, %lld] and [r, %lld] elements, it has %lld and %lld",
                    (long long)g, (long long)p->rank, (long long)k, (long long)n, (long long)p->a_capacity, (long long)p->b_capacity);
        }
    }
    for (int64_t r = 0; r < m; r++)
        REQUIRE(lora->row_adapter[r] >= -1 && lora->row_adapter[r] < lora->num_adapters, "LoRA delta: row %lld uses adapter %lld of %lld",
                (long long)r, (long long)lora->row_adapter[r], (long long)lora->num_adapters);
    return KERNEL_OK;
}

/* A prefill's site deltas in one call: PyTorch's four small ops per adapter group and site
 * (index_select, two matmuls, index_add_) each paid a thread barrier and the dispatcher, ~0.1 ms
 * apiece at two threads — more than their arithmetic. A row an iteration; a prompt's rows are
 * consecutive, so a thread's next row reads the same adapter's pairs from its caches. */
int lora_delta(const Lora *lora, int64_t num_layers, int64_t layer, int64_t first, int64_t count, const int64_t *shapes,
               const float *x, int64_t m, int64_t ldx, int64_t x_capacity, float *y, int64_t ldy, int64_t y_capacity,
               int num_threads) {
    const int status = check_lora_delta(lora, num_layers, layer, first, count, shapes, m, ldx, x_capacity, ldy, y_capacity,
                                        num_threads);
    if (status) return status;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const int64_t g = lora->row_adapter[r];
        if (g < 0) continue;
        float xa[LORA_MAX_RANK];
        for (int64_t j = 0; j < count; j++) {
            const LoraPair *p = &lora->pairs[(g * num_layers + layer) * LORA_PROJECTIONS + first + j];
            if (p->a == NULL) continue;
            const int64_t k = shapes[3 * j], n = shapes[3 * j + 1], offset = shapes[3 * j + 2];
            shrink(p, x + r * ldx, k, 0, k, xa);
            expand(p, xa, n, 0, n, y + r * ldy + offset);
        }
    }
    return KERNEL_OK;
}
