/* Decode attention straight from the paged KV pool, for CPUs.
 *
 * One sequence per work item. Its context is walked a block at a time, each block read whole and
 * in order (all KV heads of a row are adjacent in the pool), and as the rows of the current block
 * are read the same rows of the next block are prefetched, a few lines after every few read: the
 * access pattern a memory system streams best, although the blocks are scattered through the
 * pool. Each K/V byte of the context is read once from memory and nothing is gathered into a
 * padded copy.
 *
 * Within a block, rows are taken ROWS at a time (8 with AVX-512, 4 with AVX2) and the arithmetic
 * is register-blocked over the query heads of a KV head, up to QC = 3 of its GQA group at once,
 * in vectors of the library's width (16 floats with AVX-512, 8 with AVX2; GCC/Clang vector
 * extensions, intrinsics only to widen 16-bit elements and round):
 *  - scores: each K chunk (VW elements of a row) is widened once — bf16 with one vpermw, float16
 *    with one vcvtph2ps — and multiplied into the accumulators of all QC heads, QC x ROWS vectors
 *    in registers; a shuffle tree then reduces a head's ROWS accumulators to ROWS scores at once
 *    (~3 instructions a score) rather than a horizontal sum per dot product;
 *  - exponentials: a head's scores less their largest, in whole vectors (the scores buffer is
 *    padded to them), the 1 / sum kept for the end;
 *  - weighted sum: each V chunk is widened once for all QC heads, and each output chunk gets the
 *    tile's ROWS rows added in a register (one load and store a tile); the output is scaled by
 *    1 / sum once at the end rather than every probability.
 * (Before, every query head re-read and re-widened the tile's rows for itself: with a bf16 pool,
 * twice as many instructions widened elements as multiplied them.) A larger group goes in blocks
 * of up to QC heads, each widening the rows again; a head_dim that is an odd number of half
 * vectors (24 with AVX-512) ends in a half chunk whose other lanes are 0.
 * A tile never spans blocks; a short one (the end of a block or of the context) repeats its last
 * row with probability 0, so the code path and summation order depend only on the sequence. The
 * sums are kept in the order written (pin()): -ffast-math would let the compiler reorder them,
 * and it orders them differently for a float32 pool's loaded values and a bfloat16 pool's widened
 * ones.
 *
 * Parallelised with OpenMP: torch has already loaded libgomp.so.1, so this shares torch's thread
 * pool rather than starting a second one. A sequence is computed by one thread in a fixed order,
 * so its result does not depend on what else is in the batch.
 *
 * q, out: [B, Hkv, G, D] (query head h*G + g reads KV head h), D a multiple of 8, rows q_stride
 * and out_stride floats apart (q may be a slice of the fused q/k projection); k_cache,
 * v_cache: [num_blocks, block_size, Hkv, D], float32, bfloat16 or float16 (`_bf16`, `_f16`: each element widened
 * exactly as it is loaded, so the arithmetic is that of a float32 pool holding the same values);
 * block_tables: [B, max_blocks]; ctx_lens: [B];
 * window <= 0: no window.
 *
 * attend_part() is attend_rows() over a part of the context (positions [p0, p1)), returning what
 * merge_parts() needs to combine a context's parts (the fused step's threads share a long context
 * that way: decode_step.c, ATTEND_PART).
 * attend_sequence() is the work of one sequence for a range of KV heads; attend_rows() that of
 * several query rows of one sequence at consecutive positions (a speculative verification: the
 * newest token and its proposals), each attending up to its own position, with every K/V row read
 * from memory once for all of them. A row's arithmetic is the same as alone (its scores past its
 * context get probability 0, and 0 * v adds nothing), so its result is the same bits. The fused
 * decode step (decode_step.c) hands its (sequence, KV head) items to its threads with these; a
 * KV head's result does not depend on the range it is computed in.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))
#define ROWS (VW / 2) /* K/V rows per tile: 8 (AVX-512) or 4 (AVX2), QC x ROWS accumulators in registers */
#define QC 3          /* query heads per register block: SmolLM2's and many models' whole GQA group */

/* VW / 2 floats at p into the lower half of a vector whose upper half is 0, and back. */
static inline vf load_half(const float *p) {
#if VW == 16
    return (vf)_mm512_zextps256_ps512(_mm256_loadu_ps(p));
#else
    vf v = {0};
    memcpy(&v, p, sizeof(float) * VW / 2);
    return v;
#endif
}

static inline void store_half(float *p, vf v) {
#if VW == 16
    _mm256_storeu_ps(p, _mm512_castps512_ps256((__m512)v));
#else
    memcpy(p, &v, sizeof(float) * VW / 2);
#endif
}

/* x, unchanged, as a value the compiler cannot see through. Under -ffast-math it may reassociate
 * a chain of sums, and it picks the order by where the operands come from, which differs between
 * a float32 pool (loaded) and a bfloat16 one (widened): passing each partial sum through an empty
 * asm keeps the order as written, so the two pools' sums round alike. */
static inline vf pin(vf x) {
#if defined(__AVX__)
    __asm__("" : "+v"(x)); /* in its register */
#else
    __asm__("" : "+m"(x)); /* through memory: a build without AVX has no register of this size */
#endif
    return x;
}

#if defined(__AVX512BW__)
/* The 16 bf16 values in the lower half of `bits` as floats, in one instruction (vpermw with
 * zero-masking: value i to the upper half of lane i, the lower halves 0) where vpmovzxwd + vpslld
 * take two, both on the ports the FMAs use. */
static inline vf widen_bf16(__m512i bits) {
    const __m512i index = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4,
                                           3, 3, 2, 2, 1, 1, 0, 0);
    return (vf)_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, index, bits);
}
#endif

/* VW K/V elements at element d of a row, as floats. */
static ALWAYS_INLINE vf kv_chunk(const void *row, int64_t d, const int kv) {
#if defined(__AVX512BW__)
    if (kv == KV_BF16) return widen_bf16(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))));
#endif
    return kv_loadv(row, d, kv);
}

/* VW / 2 K/V elements at element d of a row, as floats, the other lanes 0: the last piece of a
 * head_dim that is an odd number of half vectors (24 with AVX-512; with 8-float vectors there is
 * none). */
static ALWAYS_INLINE vf kv_half(const void *row, int64_t d, const int kv) {
#if VW == 16
    return (vf)_mm512_zextps256_ps512((__m256)kv_load8(row, d, kv));
#else
    vf v = {0};
    for (int i = 0; i < VW / 2; i++) v[i] = kv_at(row, d + i, kv);
    return v;
#endif
}

/* Lane r (r < ROWS) of the result is the sum of a[r]'s lanes. Each round folds every row's lanes
 * of two vectors in half into one vector (a shuffle each way and an add), so ROWS rows take
 * ROWS - 1 rounds and a last fold within the vector, ~3 instructions a score, rather than a
 * horizontal sum of its own per dot product. */
#define SHUF __builtin_shufflevector
static inline vf sum_rows(const vf a[ROWS]) {
#if VW == 16
    vf b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUF(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUF(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vf d = SHUF(c[0], c[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 SHUF(c[0], c[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(d, d, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
           SHUF(d, d, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
#else
    vf b[2];
    for (int i = 0; i < 2; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    const vf c = SHUF(b[0], b[1], 0, 1, 4, 5, 8, 9, 12, 13) + SHUF(b[0], b[1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUF(c, c, 0, 2, 4, 6, 0, 2, 4, 6) + SHUF(c, c, 1, 3, 5, 7, 1, 3, 5, 7);
#endif
}

/* Into L2 (locality 1), a line at a time. Into L1 measured 7 % faster on a pool in L3 but 4-5 %
 * slower on one in memory (64 sequences, two threads); with the non-temporal hint, 2.3x slower. */
static inline void prefetch_rows(const void *rows, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)rows + i, 0, 1);
}

/* A walk over the positions [first, len) of one sequence's context in one cache, a block at a
 * time and ROWS positions at a time within a block (a tile never spans blocks). */
typedef struct {
    const char *pool;
    const int64_t *table;
    int64_t row_bytes, block_size, next, len;
} Walk;

typedef struct {
    const char *rows[ROWS]; /* position t0 + r's row (all KV heads) for r < n; the last row repeated after that */
    int64_t t0, n;
    const char *ahead; /* the same rows of the next block: what is left of them to prefetch */
    int64_t ahead_bytes;
} Tile;

/* As many bytes of the tile's share of the next block as were just read: the prefetches spread
 * through the arithmetic. Asked for all at the start of a tile, they queue behind L1's few miss
 * buffers: 1.25x slower on a pool in L3 (64 sequences, one thread), the same from memory. */
static inline void prefetch_ahead(Tile *t, int64_t bytes) {
    bytes = bytes < t->ahead_bytes ? bytes : t->ahead_bytes;
    if (bytes <= 0) return;
    prefetch_rows(t->ahead, bytes);
    t->ahead += bytes;
    t->ahead_bytes -= bytes;
}

static inline Walk walk(const void *cache, const int64_t *table, int64_t first, int64_t len, Shape s) {
    return (Walk){cache, table, s.num_kv_heads * s.head_dim * (int64_t)kv_bytes(s.kv), s.block_size, first, len};
}

/* The walk's next tile into *t, 0 when there is none. */
static inline int next_tile(Walk *w, Tile *t) {
    if (w->next >= w->len) return 0;
    const int64_t bs = w->block_size, blk = w->next / bs, stop = (blk + 1) * bs < w->len ? (blk + 1) * bs : w->len;
    t->t0 = w->next;
    t->n = stop - t->t0 < ROWS ? stop - t->t0 : ROWS;
    const char *block = w->pool + w->table[blk] * bs * w->row_bytes;
    t->ahead = NULL;
    t->ahead_bytes = 0;
    if (stop < w->len) {
        t->ahead = w->pool + (w->table[blk + 1] * bs + t->t0 - blk * bs) * w->row_bytes;
        t->ahead_bytes = t->n * w->row_bytes;
    }
    for (int64_t r = 0; r < ROWS; r++) t->rows[r] = block + (t->t0 - blk * bs + (r < t->n ? r : t->n - 1)) * w->row_bytes;
    w->next += t->n;
    return 1;
}

/* acc[g][r] += q_g . rows[r] over the elements [d, d + VW) (`half`: [d, d + VW / 2)) for query
 * heads g < qc, D floats apart from q: each K chunk is widened once for all qc heads. */
static ALWAYS_INLINE void dot_chunk(const float *q, int64_t D, int64_t d, const void *const rows[ROWS], vf acc[QC][ROWS],
                                    Tile *t, const int qc, const int half, const int kv) {
    prefetch_ahead(t, ROWS * (half ? VW / 2 : VW) * (int64_t)kv_bytes(kv));
    vf qd[QC];
    for (int g = 0; g < qc; g++) qd[g] = half ? load_half(q + g * D + d) : loadv(q + g * D + d);
    for (int r = 0; r < ROWS; r++) {
        const vf k = half ? kv_half(rows[r], d, kv) : kv_chunk(rows[r], d, kv);
        for (int g = 0; g < qc; g++) acc[g][r] = pin(acc[g][r] + qd[g] * k);
    }
}

/* scores[g * stride + r] = scale * q_g . rows[r][0 .. D) for query heads g < qc and the tile's
 * rows r < ROWS (those past a short tile's end are overwritten by the next tile, or lie in the
 * padding): ROWS vector accumulators a head, reduced to ROWS scores at once (sum_rows). */
static ALWAYS_INLINE void score_heads(const float *q, int64_t D, const void *const rows[ROWS], Tile *t, float scale,
                                      float *scores, int64_t stride, const int qc, const int kv) {
    vf acc[QC][ROWS];
    memset(acc, 0, sizeof acc);
    int64_t d = 0;
    for (; d + VW <= D; d += VW) dot_chunk(q, D, d, rows, acc, t, qc, 0, kv);
    if (d < D) dot_chunk(q, D, d, rows, acc, t, qc, 1, kv);
    for (int g = 0; g < qc; g++) {
        const vf dots = sum_rows(acc[g]) * scale;
        memcpy(scores + g * stride, &dots, sizeof(float) * ROWS);
    }
}

/* out_g[d .. d + VW) (`half`: VW / 2) += sum over the tile's rows r of w[g * ws + r] * rows[r][d ..]
 * for query heads g < qc, D floats apart from out: each V chunk widened once for all qc heads,
 * each output chunk loaded and stored once a tile. */
static ALWAYS_INLINE void weigh_chunk(float *out, int64_t D, int64_t d, const void *const rows[ROWS], const float *w, int64_t ws,
                                      Tile *t, const int qc, const int half, const int kv) {
    prefetch_ahead(t, ROWS * (half ? VW / 2 : VW) * (int64_t)kv_bytes(kv));
    vf v[ROWS];
    for (int r = 0; r < ROWS; r++) v[r] = half ? kv_half(rows[r], d, kv) : kv_chunk(rows[r], d, kv);
    for (int g = 0; g < qc; g++) {
        const float *wg = w + g * ws;
        /* Read the weights afresh each chunk, as the FMAs' broadcast operands: hoisted out of the
         * loop over chunks they are held as scalars and broadcast into a register for every FMA. */
        __asm__("" : "+r"(wg));
        float *o = out + g * D + d;
        vf acc = half ? load_half(o) : loadv(o);
        for (int r = 0; r < ROWS; r++) acc = pin(acc + wg[r] * v[r]);
        half ? store_half(o, acc) : storev(o, acc);
    }
}

static ALWAYS_INLINE void weigh_heads(float *out, int64_t D, const void *const rows[ROWS], const float *w, int64_t ws, Tile *t,
                                      const int qc, const int kv) {
    int64_t d = 0;
    for (; d + VW <= D; d += VW) weigh_chunk(out, D, d, rows, w, ws, t, qc, 0, kv);
    if (d < D) weigh_chunk(out, D, d, rows, w, ws, t, qc, 1, kv);
}

typedef struct {
    const float *q;
    float *scores, *out;
    const int64_t *lens; /* row j attends to positions [first, lens[j]) */
    int64_t first, n;    /* the positions [first, first + n) of the longest row */
    int64_t stride;      /* scores[((j * (h1 - h0) * G) + qh - h0 * G) * stride + (t - first)] for row j: n and
                            room for a last tile's whole store and a last whole vector */
    float *inv;          /* inv[j * (h1 - h0) * G + qh - h0 * G]: 1 / the sum of the head's exponentials */
    int64_t h0, h1;      /* the KV heads computed */
    int64_t rows, q_stride, out_stride; /* query rows sharing the context (row j: q + j * q_stride) */
    float scale;
    Shape s;
    float *stats;         /* NULL, or each row's (largest score, sum of exponentials) per query head, a row stats_stride floats */
    int64_t stats_stride; /* apart, head qh's pair at 2 qh: what merge_parts weighs a part of the context by */
} Pass;

/* Calls `call` with the constant count of query heads from g0 on in a group of G, clipped to QC:
 * the register blocks take their shape from it. */
#define BY_QC(G, g0, call) ((G) - (g0) >= 3 ? call(3) : (G) - (g0) == 2 ? call(2) : call(1))
_Static_assert(QC == 3, "BY_QC spells out the counts 1 .. QC");

/* scores[j][qh][t] = scale * q[j][qh] . k[t][qh / G] for the tile's positions, every row j whose
 * context reaches the tile. */
static ALWAYS_INLINE void score_tile(const Pass *p, Tile *t, const int kv) {
    const int64_t D = p->s.head_dim, G = p->s.group, per_row = (p->h1 - p->h0) * G, es = (int64_t)kv_bytes(kv);
    for (int64_t j = 0; j < p->rows; j++) {
        if (t->t0 >= p->lens[j]) continue;
        for (int64_t h = p->h0; h < p->h1; h++) {
            const void *head[ROWS];
            for (int r = 0; r < ROWS; r++) head[r] = t->rows[r] + h * D * es;
            const float *q = p->q + j * p->q_stride + h * G * D;
            float *scores = p->scores + (j * per_row + (h - p->h0) * G) * p->stride + (t->t0 - p->first);
            for (int64_t g0 = 0; g0 < G; g0 += QC) {
#define SCORE(qc) score_heads(q + g0 * D, D, head, t, p->scale, scores + g0 * p->stride, p->stride, qc, kv)
                BY_QC(G, g0, SCORE);
#undef SCORE
            }
        }
    }
}

/* out[g] += sum over the tile's positions of prob[g][t] * v[t] for qc query heads of a KV head
 * (out slices D floats apart, prob rows p->stride apart): a short tile's weights are copied, 0
 * for its repeated rows; a whole one's are read where they lie. */
static ALWAYS_INLINE void weigh_group(const Pass *p, Tile *t, const void *const head[ROWS], const float *prob, float *out,
                                      const int qc, const int kv) {
    float part[QC * ROWS];
    int64_t ws = p->stride;
    if (t->n < ROWS) {
        for (int g = 0; g < qc; g++)
            for (int r = 0; r < ROWS; r++) part[g * ROWS + r] = r < t->n ? prob[g * ws + r] : 0.0f;
        prob = part, ws = ROWS;
    }
    weigh_heads(out, p->s.head_dim, head, prob, ws, t, qc, kv);
}

/* out[j][qh] += sum over the tile's positions of p[j][qh][t] * v[t][qh / G], every row j whose
 * context reaches the tile (p is 0 past a row's context). */
static ALWAYS_INLINE void weigh_tile(const Pass *p, Tile *t, const int kv) {
    const int64_t D = p->s.head_dim, G = p->s.group, per_row = (p->h1 - p->h0) * G, es = (int64_t)kv_bytes(kv);
    for (int64_t j = 0; j < p->rows; j++) {
        if (t->t0 >= p->lens[j]) continue;
        for (int64_t h = p->h0; h < p->h1; h++) {
            const void *head[ROWS];
            for (int r = 0; r < ROWS; r++) head[r] = t->rows[r] + h * D * es;
            const float *prob = p->scores + (j * per_row + (h - p->h0) * G) * p->stride + (t->t0 - p->first);
            float *out = p->out + j * p->out_stride + h * G * D;
            for (int64_t g0 = 0; g0 < G; g0 += QC) {
#define WEIGH(qc) weigh_group(p, t, head, prob + g0 * p->stride, out + g0 * D, qc, kv)
                BY_QC(G, g0, WEIGH);
#undef WEIGH
            }
        }
    }
}

static inline vf splat(float x) { return (vf){0} + x; }

/* Lanes of a where mask is set, of b elsewhere. */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp_nonpositive (kernels.h) of every lane. The scalar one in an omp simd loop leaves the last
 * n % VW scores of every head to a scalar epilogue, a dozen dependent instructions each. */
static inline vf exp_lanes(vf x) {
    const vi tiny = x < splat(-87.0f);
    const vf c = pick(tiny, splat(-87.0f), x), t = EXP_EXPONENT_ARG(c);
#if defined(__AVX512F__)
    const vf n = (vf)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const vi whole = (vi)_mm512_cvttps_epi32((__m512)n);
#elif defined(__AVX2__)
    const vf n = (vf)_mm256_floor_ps((__m256)t);
    const vi whole = (vi)_mm256_cvttps_epi32((__m256)n);
#else
    vf n;
    vi whole;
    for (int i = 0; i < VW; i++) n[i] = __builtin_floorf(t[i]), whole[i] = (int32_t)n[i];
#endif
    const vf r = EXP_REDUCED(c, n);
    vf p = splat(EXP_LEAD);
    EXP_POLY(p, r);
    return pick(tiny, splat(0.0f), p * (vf)((whole + 127) << 23));
}

/* The lane-wise larger of a and b: one vmaxps (a compare and a blend take three instructions, on
 * the path from one vector of scores to the next). */
static inline vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX2__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return pick(b > a, b, a);
#endif
}

static inline vf combine(vf a, vf b, const int sum) { return sum ? a + b : vmax(a, b); }

/* The largest lane of x, or the sum of its lanes (`sum`), by halves. */
static inline float fold(vf x, const int sum) {
#if VW == 16
    x = combine(x, SHUF(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7), sum);
    x = combine(x, SHUF(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11), sum);
    x = combine(x, SHUF(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13), sum);
    x = combine(x, SHUF(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14), sum);
#else
    x = combine(x, SHUF(x, x, 4, 5, 6, 7, 0, 1, 2, 3), sum);
    x = combine(x, SHUF(x, x, 2, 3, 0, 1, 6, 7, 4, 5), sum);
    x = combine(x, SHUF(x, x, 1, 0, 3, 2, 5, 4, 7, 6), sum);
#endif
    return x[0];
}

/* x's first `count` lanes, -inf in the others. */
static inline vf first_lanes(vf x, int64_t count) {
    vi lane;
    for (int i = 0; i < VW; i++) lane[i] = i;
    return pick(lane < (int32_t)(count < VW ? count : VW), x, splat(-INFINITY));
}

/* A query head's n scores become their exponentials less the largest, in place, and positions
 * n .. stride - 1 (past its context, and the padding) 0; returns 1 / their sum, the normalisation
 * applied to the weighted sum at the end (once a head rather than once a score). Whole vectors
 * throughout (stride >= n rounded up to VW), the lanes past n taken as -inf. */
static float exponentiate(float *p, int64_t n, int64_t stride, float *largest) {
    if (n <= 0) { /* a part of the context this row does not reach: weight 0 when parts are merged */
        memset(p, 0, sizeof(float) * stride);
        *largest = -INFINITY;
        return 0.0f;
    }
    vf top = splat(-INFINITY), sum = {0};
    for (int64_t c = 0; c < n; c += VW) top = vmax(top, first_lanes(loadv(p + c), n - c));
    const float max = fold(top, 0);
    *largest = max;
    int64_t c = 0;
    for (; c < n; c += VW) {
        const vf e = exp_lanes(first_lanes(loadv(p + c), n - c) - max);
        storev(p + c, e);
        sum += e;
    }
    memset(p + c, 0, sizeof(float) * (stride - c));
    return 1.0f / fold(sum, 1);
}

/* attend_rows for the pool element type kv (a constant after inlining): the scores pass over K,
 * the exponentials, the weighted-sum pass over V, the normalisation. */
static ALWAYS_INLINE void attend_passes(const Pass *p, const void *k_cache, const void *v_cache, const int64_t *table,
                                        const int kv) {
    const Shape s = p->s;
    const int64_t len = p->first + p->n, heads = (p->h1 - p->h0) * s.group, D = s.head_dim;
    Tile t;
    for (Walk w = walk(k_cache, table, p->first, len, s); next_tile(&w, &t);) score_tile(p, &t, kv);
    const int64_t block_bytes = s.block_size * s.num_kv_heads * D * (int64_t)kv_bytes(kv);
    if (p->n > 0) prefetch_rows((const char *)v_cache + table[p->first / s.block_size] * block_bytes, block_bytes); /* meanwhile */
    for (int64_t j = 0; j < p->rows; j++) {
        for (int64_t i = 0; i < heads; i++) {
            float largest;
            p->inv[j * heads + i] = exponentiate(p->scores + (j * heads + i) * p->stride, p->lens[j] - p->first, p->stride, &largest);
            if (p->stats != NULL) {
                float *stat = p->stats + j * p->stats_stride + (p->h0 * s.group + i) * 2;
                stat[0] = largest, stat[1] = p->inv[j * heads + i] > 0.0f ? 1.0f / p->inv[j * heads + i] : 0.0f;
            }
        }
        memset(p->out + j * p->out_stride + p->h0 * s.group * D, 0, sizeof(float) * heads * D);
    }
    for (Walk w = walk(v_cache, table, p->first, len, s); next_tile(&w, &t);) weigh_tile(p, &t, kv);
    for (int64_t j = 0; j < p->rows; j++)
        for (int64_t i = 0; i < heads; i++) {
            float *o = p->out + j * p->out_stride + (p->h0 * s.group + i) * D;
            for (int64_t d = 0; d < D; d++) o[d] *= p->inv[j * heads + i];
        }
}

int attend_part(const float *q, int64_t q_stride, int64_t rows, const int64_t *lens, const void *k_cache, const void *v_cache,
                const int64_t *table, int64_t window, float scale, Shape s, int64_t h0, int64_t h1, float *out,
                int64_t out_stride, int64_t p0, int64_t p1, float *stats, int64_t stats_stride) {
    const int64_t whole = lens[rows - 1];
    const int64_t start = window > 0 && whole > window ? whole - window : 0;
    if (start > 0 && rows > 1) { /* each row's window starts elsewhere: one row at a time */
        for (int64_t j = 0; j < rows; j++)
            if (attend_part(q + j * q_stride, q_stride, 1, lens + j, k_cache, v_cache, table, window, scale, s, h0, h1,
                            out + j * out_stride, out_stride, p0, p1, stats == NULL ? NULL : stats + j * stats_stride, stats_stride))
                return KERNEL_NO_MEMORY;
        return KERNEL_OK;
    }
    const int64_t first = start > p0 ? start : p0, len = whole < p1 ? whole : p1;
    const int64_t heads = (h1 - h0) * s.group, n = len > first ? len - first : 0, stride = n + VW;
    /* each row's end within [p0, p1), then the scores (the int64s first: aligned as malloc's block is) */
    int64_t *clipped = malloc(sizeof(int64_t) * rows + sizeof(float) * (rows * heads * (stride + 1) - PAGEDLLM_TEST_OFF_BY_ONE));
    if (clipped == NULL) return KERNEL_NO_MEMORY;
    float *scores = (float *)(clipped + rows);
    for (int64_t j = 0; j < rows; j++) clipped[j] = lens[j] < p1 ? lens[j] : p1;
    const Pass pass = {q,  scores,   out,           clipped, first, n,     stride, scores + rows * heads * stride,
                       h0, h1,       rows,          q_stride, out_stride, scale, s, stats, stats_stride};
    if (s.kv == KV_BF16)
        attend_passes(&pass, k_cache, v_cache, table, KV_BF16);
    else if (s.kv == KV_F16)
        attend_passes(&pass, k_cache, v_cache, table, KV_F16);
    else
        attend_passes(&pass, k_cache, v_cache, table, KV_F32);
    free(clipped);
    return KERNEL_OK;
}

void merge_parts(const float *parts, const float *stats, int64_t num_parts, int64_t heads, int64_t head_dim, float *out) {
    const int64_t width = heads * head_dim;
    int64_t reached = 0, only = 0; /* a row whose context lies in one part: that part's bits, as when it is computed whole */
    for (int64_t c = 0; c < num_parts; c++)
        if (stats[c * 2 * heads + 1] != 0.0f) reached++, only = c;
    if (reached == 1) {
        memcpy(out, parts + only * width, sizeof(float) * width);
        return;
    }
    for (int64_t qh = 0; qh < heads; qh++) {
        float top = -INFINITY;
        for (int64_t c = 0; c < num_parts; c++) top = stats[c * 2 * heads + 2 * qh] > top ? stats[c * 2 * heads + 2 * qh] : top;
        float total = 0.0f;
        float *o = out + qh * head_dim;
        memset(o, 0, sizeof(float) * head_dim);
        for (int64_t c = 0; c < num_parts; c++) {
            const float *stat = stats + c * 2 * heads + 2 * qh;
            if (stat[1] == 0.0f) continue; /* a part the row does not reach */
            const float w = stat[1] * exp_nonpositive(stat[0] - top);
            total += w;
            const float *part = parts + c * width + qh * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] += w * part[d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
    }
}

int attend_rows(const float *q, int64_t q_stride, int64_t rows, const int64_t *lens, const void *k_cache, const void *v_cache,
                const int64_t *table, int64_t window, float scale, Shape s, int64_t h0, int64_t h1, float *out,
                int64_t out_stride) {
    return attend_part(q, q_stride, rows, lens, k_cache, v_cache, table, window, scale, s, h0, h1, out, out_stride, 0,
                       INT64_MAX, NULL, 0);
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
                        int64_t window, float scale, int num_threads, int kv) {
    const Shape s = {block_size, num_kv_heads, group, head_dim, kv};
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
                        head_dim, window, scale, num_threads, KV_F32);
}

int paged_decode_bf16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                      int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                      int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                      int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                      int64_t window, float scale, int num_threads) {
    return paged_decode(q, q_stride, q_capacity, k_cache, v_cache, num_blocks, block_tables, table_capacity, ctx_lens,
                        lens_capacity, out, out_stride, out_capacity, batch, max_blocks, block_size, num_kv_heads, group,
                        head_dim, window, scale, num_threads, KV_BF16);
}

int paged_decode_f16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                     int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                     int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                     int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                     int64_t window, float scale, int num_threads) {
    return paged_decode(q, q_stride, q_capacity, k_cache, v_cache, num_blocks, block_tables, table_capacity, ctx_lens,
                        lens_capacity, out, out_stride, out_capacity, batch, max_blocks, block_size, num_kv_heads, group,
                        head_dim, window, scale, num_threads, KV_F16);
}
