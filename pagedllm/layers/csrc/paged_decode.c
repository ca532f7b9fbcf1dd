/* Decode attention straight from the paged KV pool, for CPUs.
 *
 * One sequence per work item. Its context is walked a block at a time, each block read whole and
 * in order (all KV heads of a row are adjacent in the pool), the next block prefetched while the
 * current one is used: the access pattern a memory system streams best, although the blocks are
 * scattered through the pool. Every query head of every KV head is scored against a K row while
 * it is in cache; then the softmax; then the V rows are summed the same way. Each K/V byte of the
 * context is read once and nothing is gathered into a padded copy.
 *
 * Parallelised with OpenMP: torch has already loaded libgomp.so.1, so this shares torch's thread
 * pool rather than starting a second one. A sequence is computed by one thread in a fixed order,
 * so its result does not depend on what else is in the batch.
 *
 * q, out: [B, Hkv, G, D] (query head h*G + g reads KV head h); k_cache, v_cache: [num_blocks,
 * block_size, Hkv, D]; block_tables: [B, max_blocks]; ctx_lens: [B]; window <= 0: no window.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t block_size, num_kv_heads, group, head_dim;
} Shape;

/* The part of the context held by table entry blk: positions [*start, *stop) of [first, len).
 * Returns the base such that base + t * row_floats is position t's row, and prefetches the next
 * block while this one is used. */
static const float *block_span(const float *cache, const int64_t *table, int64_t blk, int64_t first, int64_t len,
                               Shape s, int64_t *start, int64_t *stop) {
    const int64_t row_floats = s.num_kv_heads * s.head_dim, block_floats = s.block_size * row_floats;
    *start = blk * s.block_size > first ? blk * s.block_size : first;
    *stop = (blk + 1) * s.block_size < len ? (blk + 1) * s.block_size : len;
    if (*stop < len) {
        const float *next = cache + table[blk + 1] * block_floats;
        for (int64_t i = 0; i < block_floats; i += 16) __builtin_prefetch(next + i, 0, 0);
    }
    return cache + table[blk] * block_floats - blk * block_floats;
}

/* scores[qh][t - first] = scale * q[qh] . k[t][qh / G] for positions [first, len). */
static void score(const float *restrict q, const float *restrict k_cache, const int64_t *table, int64_t first,
                  int64_t len, Shape s, float scale, float *restrict scores) {
    const int64_t n = len - first, row_floats = s.num_kv_heads * s.head_dim;
    for (int64_t blk = first / s.block_size; blk * s.block_size < len; blk++) {
        int64_t start, stop;
        const float *rows = block_span(k_cache, table, blk, first, len, s, &start, &stop);
        for (int64_t t = start; t < stop; t++) {
            for (int64_t h = 0; h < s.num_kv_heads; h++) {
                const float *k = rows + t * row_floats + h * s.head_dim;
                for (int64_t qh = h * s.group; qh < (h + 1) * s.group; qh++) {
                    const float *qv = q + qh * s.head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < s.head_dim; d++) dot += qv[d] * k[d];
                    scores[qh * n + (t - first)] = dot * scale;
                }
            }
        }
    }
}

/* exp(x) for x <= 0, within 2 ulp of expf (Cephes' expf: 2^n times a degree-6 polynomial on
 * [-ln2/2, ln2/2]), written so that the compiler vectorises it — libm's expf is a scalar call
 * and took as long as the rest of the softmax. Below -87 it returns ~1e-38 rather than 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t bits;
        float value;
    } scale = {.bits = ((int32_t)n + 127) << 23};
    return p * scale.value;
}

/* Each query head's scores become probabilities, in place. */
static void softmax(float *scores, int64_t n, int64_t heads) {
    for (int64_t qh = 0; qh < heads; qh++) {
        float *p = scores + qh * n;
        float max = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) max = p[i] > max ? p[i] : max;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) p[i] = exp_nonpositive(p[i] - max);
        for (int64_t i = 0; i < n; i++) sum += p[i];
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) p[i] *= inv;
    }
}

/* out[qh] = sum over positions of p[qh][t] * v[t][qh / G]. */
static void weigh(const float *restrict scores, const float *restrict v_cache, const int64_t *table, int64_t first,
                  int64_t len, Shape s, float *restrict out) {
    const int64_t n = len - first, row_floats = s.num_kv_heads * s.head_dim;
    for (int64_t i = 0; i < s.num_kv_heads * s.group * s.head_dim; i++) out[i] = 0.0f;
    for (int64_t blk = first / s.block_size; blk * s.block_size < len; blk++) {
        int64_t start, stop;
        const float *rows = block_span(v_cache, table, blk, first, len, s, &start, &stop);
        for (int64_t t = start; t < stop; t++) {
            for (int64_t h = 0; h < s.num_kv_heads; h++) {
                const float *v = rows + t * row_floats + h * s.head_dim;
                for (int64_t qh = h * s.group; qh < (h + 1) * s.group; qh++) {
                    const float p = scores[qh * n + (t - first)];
                    float *o = out + qh * s.head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < s.head_dim; d++) o[d] += p * v[d];
                }
            }
        }
    }
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                     const int64_t *ctx_lens, float *out, int64_t batch, int64_t max_blocks, int64_t block_size,
                     int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t window, float scale,
                     int num_threads) {
    const Shape s = {block_size, num_kv_heads, group, head_dim};
    const int64_t heads = num_kv_heads * group;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed)
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = ctx_lens[b];
        const int64_t first = window > 0 && len > window ? len - window : 0;
        float *scores = malloc(sizeof(float) * heads * (len - first));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const int64_t *table = block_tables + b * max_blocks;
        score(q + b * heads * head_dim, k_cache, table, first, len, s, scale, scores);
        softmax(scores, len - first, heads);
        weigh(scores, v_cache, table, first, len, s, out + b * heads * head_dim);
        free(scores);
    }
    return failed;
}
