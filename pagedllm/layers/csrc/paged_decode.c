/* Decode attention straight from the paged KV pool, for CPUs.
 *
 * One sequence per work item. Its context is walked a block at a time, each block read whole and
 * in order (all KV heads of a row are adjacent in the pool), the next block prefetched while the
 * current one is used: the access pattern a memory system streams best, although the blocks are
 * scattered through the pool. Each K/V byte of the context is read once from memory and nothing
 * is gathered into a padded copy.
 *
 * Within a block, rows are taken TILE = 8 at a time and the arithmetic is register-tiled in
 * vectors of the library's width (16 floats with AVX-512, where a head's size allows, else 8;
 * GCC/Clang vector extensions, so any x86 or Arm SIMD width works):
 *  - scores: every query head of a KV head is dotted with the tile's 8 K rows in 8 independent
 *    vector accumulators, which one shuffle tree then reduces to 8 scores at once — rather than
 *    a horizontal sum per dot product, which left the dot products latency-bound;
 *  - weighted sum: each 8-float slice of an output head is loaded once per tile and gets the
 *    tile's 8 V rows added in a balanced tree — rather than a load and store of the output per
 *    row.
 * A tile never spans blocks; a short one (the end of a block or of the context) repeats its last
 * row with probability 0, so the code path and summation order depend only on the sequence.
 *
 * Parallelised with OpenMP: torch has already loaded libgomp.so.1, so this shares torch's thread
 * pool rather than starting a second one. A sequence is computed by one thread in a fixed order,
 * so its result does not depend on what else is in the batch.
 *
 * q, out: [B, Hkv, G, D] (query head h*G + g reads KV head h), D a multiple of 8, rows q_stride
 * and out_stride floats apart (q may be a slice of the fused q/k projection); k_cache,
 * v_cache: [num_blocks, block_size, Hkv, D], float32 or bfloat16 (`_bf16`: each element widened
 * exactly as it is loaded, so the arithmetic is that of a float32 pool holding the same values);
 * block_tables: [B, max_blocks]; ctx_lens: [B];
 * window <= 0: no window.
 *
 * attend_sequence() is the work of one sequence for a range of KV heads; attend_rows() that of
 * several query rows of one sequence at consecutive positions (a speculative verification: the
 * newest token and its proposals), each attending up to its own position, with every K/V row read
 * once for all of them. A row's arithmetic is the same as alone (its scores past its context get
 * probability 0, and 0 * v adds nothing), so its result is the same bits. The fused decode step
 * (decode_step.c) hands its (sequence, KV head) items to its threads with these.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define TILE 8

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* Lane r of the result is the sum of the lanes of a[r]: three rounds of pairwise shuffles. */
static inline v8 sum_lanes(const v8 a[TILE]) {
    v8 s[4], u[2];
    for (int i = 0; i < 4; i++)
        s[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(s[2 * i], s[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Into L2 (locality 1), a line at a time, spread over the tiles of the current block: asking
 * for a whole block at once, or into L1, measured 1.4-1.6x slower on a pool larger than L3 —
 * the requests queue behind L1's few miss buffers instead of overlapping the arithmetic. */
static inline void prefetch_rows(const void *rows, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)rows + i, 0, 1);
}

/* Calls tile(rows, t0, n, ctx) for every tile of positions [first, len): rows[r] is position
 * t0 + r's row (all KV heads) for r < n and repeats the last row after that. While a tile is
 * computed, the same rows of the next block are prefetched. */
typedef void (*TileFn)(const void *const rows[TILE], int64_t t0, int64_t n, void *ctx);

static void for_each_tile(const void *cache, const int64_t *table, int64_t first, int64_t len, Shape s, TileFn tile,
                          void *ctx) {
    const int64_t row_bytes = s.num_kv_heads * s.head_dim * (int64_t)kv_bytes(s.kv_bf16), block_bytes = s.block_size * row_bytes;
    const char *pool = cache;
    for (int64_t blk = first / s.block_size; blk * s.block_size < len; blk++) {
        const int64_t start = blk * s.block_size > first ? blk * s.block_size : first;
        const int64_t stop = (blk + 1) * s.block_size < len ? (blk + 1) * s.block_size : len;
        /* block blk's row of position t is at base + t * row_bytes */
        const char *next = stop < len ? pool + table[blk + 1] * block_bytes - (blk + 1) * block_bytes : NULL;
        const char *base = pool + table[blk] * block_bytes - blk * block_bytes;
        for (int64_t t0 = start; t0 < stop; t0 += TILE) {
            const int64_t n = stop - t0 < TILE ? stop - t0 : TILE;
            if (next != NULL) prefetch_rows(next + (t0 + s.block_size) * row_bytes, n * row_bytes);
            const void *rows[TILE];
            for (int64_t r = 0; r < TILE; r++) rows[r] = base + (t0 + (r < n ? r : n - 1)) * row_bytes;
            tile(rows, t0, n, ctx);
        }
    }
}

typedef struct {
    const float *q;
    float *scores, *out;
    int64_t first, n;  /* scores[((j * (h1 - h0) * G) + qh - h0 * G) * n + (t - first)] for row j */
    int64_t h0, h1;    /* the KV heads computed */
    int64_t rows, q_stride, out_stride; /* query rows sharing the context (row j: q + j * q_stride) */
    float scale;
    Shape s;
} Pass;

/* acc[r] = the 8 partial sums of q . rows[r][0 .. D): in full-width vectors where D allows (half
 * the instructions of 8-float ones with AVX-512), whose halves are then added. */
static inline __attribute__((always_inline)) void dot_tile(const float *q, const void *const rows[TILE], int64_t D, v8 acc[TILE],
                                                           const int bf16) {
#if VW == 16
    if (D % VW == 0) {
        vf wide[TILE] = {0};
        for (int64_t d = 0; d < D; d += VW) {
            const vf qd = loadv(q + d);
            for (int r = 0; r < TILE; r++) wide[r] += qd * kv_loadv(rows[r], d, bf16);
        }
        for (int r = 0; r < TILE; r++)
            acc[r] = __builtin_shufflevector(wide[r], wide[r], 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(wide[r], wide[r], 8, 9, 10, 11, 12, 13, 14, 15);
        return;
    }
#endif
    for (int r = 0; r < TILE; r++) acc[r] = (v8){0};
    for (int64_t d = 0; d < D; d += 8) {
        const v8 qd = load8(q + d);
        for (int r = 0; r < TILE; r++) acc[r] += qd * kv_load8(rows[r], d, bf16);
    }
}

/* o[0 .. D) += sum over r of w[r] * rows[r][0 .. D), full-width vectors where D allows. */
static inline __attribute__((always_inline)) void weigh_rows(float *o, const float w[TILE], const void *const rows[TILE], int64_t D,
                                                             const int bf16) {
#if VW == 16
    if (D % VW == 0) {
        for (int64_t d = 0; d < D; d += VW) {
            vf acc = loadv(o + d);
            for (int r = 0; r < TILE; r++) acc += w[r] * kv_loadv(rows[r], d, bf16);
            storev(o + d, acc);
        }
        return;
    }
#endif
    for (int64_t d = 0; d < D; d += 8) {
        v8 acc = load8(o + d);
        for (int r = 0; r < TILE; r++) acc += w[r] * kv_load8(rows[r], d, bf16);
        store8(o + d, acc);
    }
}

/* scores[j][qh][t] = scale * q[j][qh] . k[t][qh / G] for the tile's positions, every row j. */
static inline __attribute__((always_inline)) void score_tile(const void *const rows[TILE], int64_t t0, int64_t n, void *ctx,
                                                             const int bf16) {
    const Pass *p = ctx;
    const int64_t D = p->s.head_dim, G = p->s.group, per_row = (p->h1 - p->h0) * G, es = (int64_t)kv_bytes(bf16);
    for (int64_t j = 0; j < p->rows; j++) {
        for (int64_t h = p->h0; h < p->h1; h++) {
            for (int64_t qh = h * G; qh < (h + 1) * G; qh++) {
                const void *head[TILE];
                for (int r = 0; r < TILE; r++) head[r] = (const char *)rows[r] + h * D * es;
                v8 acc[TILE];
                dot_tile(p->q + j * p->q_stride + qh * D, head, D, acc, bf16);
                float dots[TILE];
                store8(dots, sum_lanes(acc) * p->scale);
                memcpy(p->scores + (j * per_row + qh - p->h0 * G) * p->n + (t0 - p->first), dots, sizeof(float) * n);
            }
        }
    }
}

/* out[j][qh] += sum over the tile's positions of p[j][qh][t] * v[t][qh / G], every row j. */
static inline __attribute__((always_inline)) void weigh_tile(const void *const rows[TILE], int64_t t0, int64_t n, void *ctx,
                                                             const int bf16) {
    const Pass *p = ctx;
    const int64_t D = p->s.head_dim, G = p->s.group, per_row = (p->h1 - p->h0) * G, es = (int64_t)kv_bytes(bf16);
    for (int64_t j = 0; j < p->rows; j++) {
        for (int64_t h = p->h0; h < p->h1; h++) {
            for (int64_t qh = h * G; qh < (h + 1) * G; qh++) {
                const float *prob = p->scores + (j * per_row + qh - p->h0 * G) * p->n + (t0 - p->first);
                float w[TILE];
                const void *head[TILE];
                for (int r = 0; r < TILE; r++) w[r] = r < n ? prob[r] : 0.0f, head[r] = (const char *)rows[r] + h * D * es;
                weigh_rows(p->out + j * p->out_stride + qh * D, w, head, D, bf16);
            }
        }
    }
}

/* The tile functions for each pool element type (the type a constant inside each). */
static void score_tile_f32(const void *const rows[TILE], int64_t t0, int64_t n, void *ctx) { score_tile(rows, t0, n, ctx, 0); }
static void score_tile_bf16(const void *const rows[TILE], int64_t t0, int64_t n, void *ctx) { score_tile(rows, t0, n, ctx, 1); }
static void weigh_tile_f32(const void *const rows[TILE], int64_t t0, int64_t n, void *ctx) { weigh_tile(rows, t0, n, ctx, 0); }
static void weigh_tile_bf16(const void *const rows[TILE], int64_t t0, int64_t n, void *ctx) { weigh_tile(rows, t0, n, ctx, 1); }

/* Each query head's scores become probabilities, in place: `heads` rows of n scores, `stride`
 * apart; positions n .. stride - 1 (past this head's context) get probability 0. */
static void softmax(float *scores, int64_t n, int64_t heads, int64_t stride) {
    for (int64_t qh = 0; qh < heads; qh++) {
        float *p = scores + qh * stride;
        float max = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) max = p[i] > max ? p[i] : max;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) p[i] = exp_nonpositive(p[i] - max);
        for (int64_t i = 0; i < n; i++) sum += p[i];
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) p[i] *= inv;
        for (int64_t i = n; i < stride; i++) p[i] = 0.0f;
    }
}

int attend_rows(const float *q, int64_t q_stride, int64_t rows, const int64_t *lens, const void *k_cache, const void *v_cache,
                const int64_t *table, int64_t window, float scale, Shape s, int64_t h0, int64_t h1, float *out,
                int64_t out_stride) {
    const int64_t len = lens[rows - 1];
    const int64_t first = window > 0 && len > window ? len - window : 0;
    if (first > 0 && rows > 1) { /* each row's window starts elsewhere: one row at a time */
        for (int64_t j = 0; j < rows; j++)
            if (attend_rows(q + j * q_stride, q_stride, 1, lens + j, k_cache, v_cache, table, window, scale, s, h0, h1,
                            out + j * out_stride, out_stride))
                return KERNEL_NO_MEMORY;
        return KERNEL_OK;
    }
    const int64_t heads = (h1 - h0) * s.group;
    float *scores = malloc(sizeof(float) * (rows * heads * (len - first) - PAGEDLLM_TEST_OFF_BY_ONE));
    if (scores == NULL) return KERNEL_NO_MEMORY;
    Pass pass = {q, scores, out, first, len - first, h0, h1, rows, q_stride, out_stride, scale, s};
    for_each_tile(k_cache, table, first, len, s, s.kv_bf16 ? score_tile_bf16 : score_tile_f32, &pass);
    const int64_t block_bytes = s.block_size * s.num_kv_heads * s.head_dim * (int64_t)kv_bytes(s.kv_bf16);
    prefetch_rows((const char *)v_cache + table[first / s.block_size] * block_bytes, block_bytes); /* during the softmax */
    for (int64_t j = 0; j < rows; j++) {
        softmax(scores + j * heads * (len - first), lens[j] - first, heads, len - first);
        memset(out + j * out_stride + h0 * s.group * s.head_dim, 0, sizeof(float) * heads * s.head_dim);
    }
    for_each_tile(v_cache, table, first, len, s, s.kv_bf16 ? weigh_tile_bf16 : weigh_tile_f32, &pass);
    free(scores);
    return KERNEL_OK;
}

int attend_sequence(const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
                    int64_t window, float scale, Shape s, int64_t h0, int64_t h1, float *out) {
    return attend_rows(q, 0, 1, &len, k_cache, v_cache, table, window, scale, s, h0, h1, out, 0);
}

/* The exported kernel: `batch` sequences. Every size is checked against what the caller
 * allocated (q_capacity / out_capacity floats at q / out, table_capacity entries at
 * block_tables, batch entries at ctx_lens, num_blocks blocks in each cache) before any is used. */
static int paged_decode(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                        int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                        int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                        int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                        int64_t window, float scale, int num_threads, int kv_bf16) {
    const Shape s = {block_size, num_kv_heads, group, head_dim, kv_bf16};
    if (head_dim % 8 != 0) return KERNEL_BAD_SHAPE;
    const int64_t width = num_kv_heads * group * head_dim;
    REQUIRE(batch >= 0 && num_kv_heads > 0 && group > 0 && head_dim > 0 && num_threads > 0,
            "paged decode: batch %lld, %lld KV heads, group %lld, head_dim %lld, %d threads", (long long)batch,
            (long long)num_kv_heads, (long long)group, (long long)head_dim, num_threads);
    REQUIRE(rows_fit(batch, q_stride, width, q_capacity) && rows_fit(batch, out_stride, width, out_capacity) &&
                (batch <= 1 || out_stride >= width),
            "paged decode: %lld rows of %lld floats do not fit q (stride %lld, %lld floats) or out (stride %lld, %lld)",
            (long long)batch, (long long)width, (long long)q_stride, (long long)q_capacity, (long long)out_stride,
            (long long)out_capacity);
    REQUIRE(max_blocks >= 0 && batch * max_blocks <= table_capacity && batch <= lens_capacity,
            "paged decode: %lld tables of %lld blocks or %lld lengths exceed the %lld / %lld given", (long long)batch,
            (long long)max_blocks, (long long)batch, (long long)table_capacity, (long long)lens_capacity);
    for (int64_t b = 0; b < batch; b++) {
        REQUIRE(ctx_lens[b] >= 1, "paged decode: sequence %lld has context length %lld", (long long)b, (long long)ctx_lens[b]);
        const int status = check_table(block_tables + b * max_blocks, max_blocks, ctx_lens[b], block_size, num_blocks,
                                       "paged decode: sequence", b);
        if (status) return status;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(max : failed)
    for (int64_t b = 0; b < batch; b++)
        failed = worse_status(failed, attend_sequence(q + b * q_stride, k_cache, v_cache, block_tables + b * max_blocks,
                                                      ctx_lens[b], window, scale, s, 0, num_kv_heads, out + b * out_stride));
    return failed;
}

int paged_decode_f32(const float *q, int64_t q_stride, int64_t q_capacity, const float *k_cache, const float *v_cache,
                     int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                     int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                     int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                     int64_t window, float scale, int num_threads) {
    return paged_decode(q, q_stride, q_capacity, k_cache, v_cache, num_blocks, block_tables, table_capacity, ctx_lens,
                        lens_capacity, out, out_stride, out_capacity, batch, max_blocks, block_size, num_kv_heads, group,
                        head_dim, window, scale, num_threads, 0);
}

int paged_decode_bf16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                      int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                      int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                      int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                      int64_t window, float scale, int num_threads) {
    return paged_decode(q, q_stride, q_capacity, k_cache, v_cache, num_blocks, block_tables, table_capacity, ctx_lens,
                        lens_capacity, out, out_stride, out_capacity, batch, max_blocks, block_size, num_kv_heads, group,
                        head_dim, window, scale, num_threads, 1);
}
