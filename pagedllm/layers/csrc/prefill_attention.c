/* Prefill attention straight from the paged KV pool, for CPUs.
 *
 * A prefill chunk's query rows attend causally to the context before them, whose K/V the step has
 * just written into the pool. Decode attention (paged_decode.c) dots one query with each K row,
 * which needs a horizontal sum per score; with many query rows the work is a small matrix product
 * instead, and is laid out like one: a tile of VW consecutive query rows of one query head is
 * transposed once (its head_dim x VW floats stay in L1), so that
 *  - scores: each K row's element is broadcast against a vector of the tile's VW queries — one
 *    FMA per element per 16 (or 8) scores, no horizontal sums — for 8 positions at a time in
 *    independent accumulators;
 *  - softmax: the scores of a position are a vector across the tile's rows, so the causal and
 *    window masks, the running max, exp and the sum are vector operations across rows;
 *  - weighted sum: 4 rows x up to 4 vectors of an output head are held in 16 accumulators while
 *    the V rows stream past (each loaded once for the 4 rows), each row's probabilities
 *    broadcast; the 1/sum is applied once at the end.
 * Work items are (row tile, query head), longest contexts first under OpenMP's dynamic schedule,
 * so a short prompt with few heads still makes many small items for the threads, and a tile
 * computes scores only up to its last row's position. K/V rows are found through the block
 * table; nothing is gathered or padded.
 *
 * q, out: [q_len, Hkv, G, D] rows q_stride / out_stride floats apart, row r at position
 * ctx_len - q_len + r; caches [num_blocks, block_size, Hkv, D], float32, bfloat16 or float16
 * (`_bf16`, `_f16`: widened exactly as loaded); D a multiple of 8 (fastest a
 * multiple of VW); window <= 0: no window.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define PB 8 /* positions per score micro-tile: independent FMA chains */
#define RB 4 /* query rows per weighted-sum micro-tile */
#define SB 4 /* output vectors per weighted-sum micro-tile */

typedef struct {
    const void *k_cache, *v_cache; /* of the element type s.kv */
    const int64_t *table;
    Shape s;
    int64_t window;
    float scale;
} Pool;

/* Row of position t, KV head h. */
static inline const void *pool_row(const void *cache, const Pool *p, int64_t t, int64_t h) {
    const int64_t bs = p->s.block_size;
    return (const char *)cache + ((p->table[t / bs] * bs + t % bs) * p->s.num_kv_heads + h) * p->s.head_dim *
                                     (int64_t)kv_bytes(p->s.kv);
}

/* qt[d][j] = q row j's element d, for the tile's n rows (0 for lanes past them). */
static void transpose_tile(const float *q, int64_t q_stride, int64_t n, int64_t D, float *qt) {
    memset(qt, 0, sizeof(float) * D * VW);
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d++) qt[d * VW + j] = q[j * q_stride + d];
}

/* Lanes of a where mask is set, of b elsewhere (C has no vector ?:). */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* scores[(t - lo) * VW + j] = scale * q_j . k_t for positions [lo, hi), -inf where row j (at
 * position p0 + j) may not look; lanes past the tile's n rows (q 0) see everything, so that no
 * lane is all -inf. */
static inline __attribute__((always_inline)) void score(const float *qt, int64_t n_rows, const Pool *p, int64_t h, int64_t p0,
                                                        int64_t lo, int64_t hi, float *scores, const int kv) {
    const int64_t D = p->s.head_dim;
    const vf hidden = (vf){0} - INFINITY;
    vi lane;
    for (int j = 0; j < VW; j++) lane[j] = j;
    for (int64_t t0 = lo; t0 < hi; t0 += PB) {
        const int64_t n = hi - t0 < PB ? hi - t0 : PB;
        const void *k[PB];
        for (int64_t i = 0; i < PB; i++) k[i] = pool_row(p->k_cache, p, t0 + (i < n ? i : n - 1), h);
        vf acc[PB] = {0};
        for (int64_t d = 0; d < D; d++) {
            const vf qd = loadv(qt + d * VW);
            for (int i = 0; i < PB; i++) acc[i] += kv_at(k[i], d, kv) * qd;
        }
        for (int64_t i = 0; i < n; i++) {
            const int32_t back = (int32_t)(t0 + i - p0); /* row j sees position t0 + i when j >= back */
            vi visible = lane >= back;
            if (p->window > 0) visible &= lane < back + (int32_t)p->window;
            visible |= lane >= (int32_t)n_rows;
            storev(scores + (t0 + i - lo) * VW, pick(visible, acc[i] * p->scale, hidden));
        }
    }
}

/* scores become exp(score - max) in place, lane by lane; returns 1 / sum per lane. */
static vf exponentiate(float *scores, int64_t n) {
    vf max = loadv(scores);
    for (int64_t t = 1; t < n; t++) {
        const vf x = loadv(scores + t * VW);
        max = pick(x > max, x, max);
    }
    float top[VW];
    storev(top, max);
    vf sum = {0};
    for (int64_t t = 0; t < n; t++) {
        float *row = scores + t * VW;
#pragma omp simd
        for (int j = 0; j < VW; j++) row[j] = exp_nonpositive(row[j] - top[j]);
        sum += loadv(row);
    }
    return 1.0f / sum;
}

/* The first `width` floats of p (the rest 0), and their store: a head_dim that is a multiple of
 * 8 but not of VW ends in half a vector. */
static inline vf load_part(const float *p, int64_t width) {
    vf v = {0};
    memcpy(&v, p, sizeof(float) * width);
    return v;
}

/* `width` K/V elements from element d of a row (the rest 0), as floats. */
static inline __attribute__((always_inline)) vf kv_load_part(const void *row, int64_t d, int64_t width, const int kv) {
    if (kv == KV_F32) return load_part((const float *)row + d, width);
    vf v = {0};
    for (int64_t i = 0; i < width; i++) v[i] = kv_at(row, d + i, kv);
    return v;
}

static inline void store_part(float *p, vf v, int64_t width) { memcpy(p, &v, sizeof(float) * width); }

/* out rows [j0, j0 + rows) (rows <= RB), floats [f0, f0 + nf) (nf <= SB * VW) of head qh:
 * inv[j] * sum over t in [lo, hi) of probs[t][j] * v_t. */
static inline __attribute__((always_inline)) void weigh(const float *probs, vf inv, const Pool *p, int64_t h, int64_t lo, int64_t hi, int64_t j0, int64_t rows,
                  int64_t f0, int64_t nf, float *out, int64_t out_stride, const int kv) {
    const int64_t nv = (nf + VW - 1) / VW, tail = nf - (nv - 1) * VW;
    vf acc[RB][SB];
    memset(acc, 0, sizeof acc);
    for (int64_t t = lo; t < hi; t++) {
        const void *v = pool_row(p->v_cache, p, t, h);
        const float *w = probs + (t - lo) * VW + j0;
        vf vv[SB];
        for (int s = 0; s < SB; s++)
            vv[s] = s < nv - 1 ? kv_loadv(v, f0 + s * VW, kv) : s == nv - 1 ? kv_load_part(v, f0 + s * VW, tail, kv) : (vf){0};
        for (int r = 0; r < RB; r++)
            for (int s = 0; s < SB; s++) acc[r][s] += w[r] * vv[s];
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < nv; s++)
            store_part(out + r * out_stride + f0 + s * VW, acc[r][s] * inv[j0 + r], s < nv - 1 ? VW : tail);
}

/* One work item, for the pool element type kv (a constant after inlining). */
static inline __attribute__((always_inline)) int attend_tile_t(const float *q, int64_t q_stride, int64_t n, int64_t p0,
                                                               int64_t qh, const Pool *p, float *out, int64_t out_stride,
                                                               const int kv) {
    const int64_t D = p->s.head_dim, h = qh / p->s.group, hi = p0 + n;
    const int64_t lo = p->window > 0 && p0 + 1 > p->window ? p0 + 1 - p->window : 0;
    const size_t bytes = sizeof(float) * (size_t)((D + hi - lo) * VW);
    float *buffer = aligned_alloc(64, (bytes + 63) / 64 * 64); /* a multiple of the alignment */
    if (buffer == NULL) return KERNEL_NO_MEMORY;
    float *qt = buffer;
    float *scores = buffer + D * VW;
    transpose_tile(q + qh * D, q_stride, n, D, qt);
    score(qt, n, p, h, p0, lo, hi, scores, kv);
    const vf inv = exponentiate(scores, hi - lo);
    for (int64_t j0 = 0; j0 < n; j0 += RB) {
        const int64_t rows = n - j0 < RB ? n - j0 : RB;
        /* rows past j0 + rows - 1 see no further; a window hides what is before its first row */
        const int64_t first = p->window > 0 && p0 + j0 + 1 > p->window ? p0 + j0 + 1 - p->window : lo;
        const float *probs = scores + (first - lo) * VW;
        float *o = out + j0 * out_stride + qh * D;
        for (int64_t f0 = 0; f0 < D; f0 += SB * VW) {
            if (D - f0 >= SB * VW) /* a constant width: the loads and FMAs unroll */
                weigh(probs, inv, p, h, first, p0 + j0 + rows, j0, rows, f0, SB * VW, o, out_stride, kv);
            else
                weigh(probs, inv, p, h, first, p0 + j0 + rows, j0, rows, f0, D - f0, o, out_stride, kv);
        }
    }
    free(buffer);
    return KERNEL_OK;
}

/* One work item: the tile of n rows starting at row r0 (position p0), query head qh. */
static int attend_tile(const float *q, int64_t q_stride, int64_t n, int64_t p0, int64_t qh, const Pool *p, float *out,
                       int64_t out_stride) {
    switch (p->s.kv) {
    case KV_BF16: return attend_tile_t(q, q_stride, n, p0, qh, p, out, out_stride, KV_BF16);
    case KV_F16: return attend_tile_t(q, q_stride, n, p0, qh, p, out, out_stride, KV_F16);
    default: return attend_tile_t(q, q_stride, n, p0, qh, p, out, out_stride, KV_F32);
    }
}

/* The exported kernel. Every size is checked against what the caller allocated (q_capacity /
 * out_capacity floats at q / out, max_blocks entries at table, num_blocks blocks in each cache)
 * before any is used. */
static int prefill_attention(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                             int64_t num_blocks, const int64_t *table, int64_t max_blocks, int64_t q_len, int64_t ctx_len,
                             float *out, int64_t out_stride, int64_t out_capacity, int64_t block_size, int64_t num_kv_heads,
                             int64_t group, int64_t head_dim, int64_t window, float scale, int num_threads, int kv) {
    if (head_dim % 8 != 0) return KERNEL_BAD_SHAPE;
    const int64_t width = num_kv_heads * group * head_dim;
    REQUIRE(num_kv_heads > 0 && group > 0 && num_threads > 0, "prefill attention: %lld KV heads, group %lld, %d threads",
            (long long)num_kv_heads, (long long)group, num_threads);
    REQUIRE(q_len >= 0 && q_len <= ctx_len, "prefill attention: %lld query rows in a context of %lld", (long long)q_len,
            (long long)ctx_len);
    REQUIRE(rows_fit(q_len, q_stride, width, q_capacity) && rows_fit(q_len, out_stride, width, out_capacity) &&
                (q_len <= 1 || out_stride >= width),
            "prefill attention: %lld rows of %lld floats do not fit q (stride %lld, %lld floats) or out (stride %lld, %lld)",
            (long long)q_len, (long long)width, (long long)q_stride, (long long)q_capacity, (long long)out_stride,
            (long long)out_capacity);
    const int status = check_table(table, max_blocks, ctx_len, block_size, num_blocks, "prefill attention: chunk", 0);
    if (status) return status;
    const Pool p = {k_cache, v_cache, table, {block_size, num_kv_heads, group, head_dim, kv}, window, scale};
    const int64_t heads = num_kv_heads * group, tiles = (q_len + VW - 1) / VW, items = tiles * heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(max : failed)
    for (int64_t i = 0; i < items; i++) {
        const int64_t tile = tiles - 1 - i / heads, qh = i % heads; /* longest contexts first */
        const int64_t r0 = tile * VW, n = q_len - r0 < VW ? q_len - r0 : VW;
        failed = worse_status(failed, attend_tile(q + r0 * q_stride, q_stride, n, ctx_len - q_len + r0, qh, &p,
                                                  out + r0 * out_stride, out_stride));
    }
    return failed;
}

int prefill_attention_f32(const float *q, int64_t q_stride, int64_t q_capacity, const float *k_cache, const float *v_cache,
                          int64_t num_blocks, const int64_t *table, int64_t max_blocks, int64_t q_len, int64_t ctx_len,
                          float *out, int64_t out_stride, int64_t out_capacity, int64_t block_size, int64_t num_kv_heads,
                          int64_t group, int64_t head_dim, int64_t window, float scale, int num_threads) {
    return prefill_attention(q, q_stride, q_capacity, k_cache, v_cache, num_blocks, table, max_blocks, q_len, ctx_len, out,
                             out_stride, out_capacity, block_size, num_kv_heads, group, head_dim, window, scale, num_threads, KV_F32);
}

int prefill_attention_bf16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                           int64_t num_blocks, const int64_t *table, int64_t max_blocks, int64_t q_len, int64_t ctx_len,
                           float *out, int64_t out_stride, int64_t out_capacity, int64_t block_size, int64_t num_kv_heads,
                           int64_t group, int64_t head_dim, int64_t window, float scale, int num_threads) {
    return prefill_attention(q, q_stride, q_capacity, k_cache, v_cache, num_blocks, table, max_blocks, q_len, ctx_len, out,
                             out_stride, out_capacity, block_size, num_kv_heads, group, head_dim, window, scale, num_threads, KV_BF16);
}

int prefill_attention_f16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                          int64_t num_blocks, const int64_t *table, int64_t max_blocks, int64_t q_len, int64_t ctx_len,
                          float *out, int64_t out_stride, int64_t out_capacity, int64_t block_size, int64_t num_kv_heads,
                          int64_t group, int64_t head_dim, int64_t window, float scale, int num_threads) {
    return prefill_attention(q, q_stride, q_capacity, k_cache, v_cache, num_blocks, table, max_blocks, q_len, ctx_len, out,
                             out_stride, out_capacity, block_size, num_kv_heads, group, head_dim, window, scale, num_threads,
                             KV_F16);
}
