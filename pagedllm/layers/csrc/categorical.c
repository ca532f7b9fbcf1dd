/* Sampling a token from each of a few rows of logits: softmax(x / T), the tokens under min_p
 * times the most likely one's probability dropped, drawn by inverse transform sampling of one
 * uniform number per row.
 *
 * Why in C, and why inverse transform: the exponential race (argmax of p / E, E ~ Exp(1) a token)
 * the sampler runs elsewhere needs a random number for every token of the vocabulary. On the CPU
 * a sampled token cost ~1.4 ms over a greedy one in a ~5 ms single-stream step: 49k uniform
 * draws and their logarithms, the softmax, the divisions and argmaxes, each a torch op over the
 * whole row. A draw from the same distribution needs one uniform number u: the first token whose
 * cumulative weight exceeds u times the total. Here that is three vector passes over a row still
 * in L2 — its maximum, the weights exp((x - max) / T) summed by blocks, and the walk to u's block
 * — and one scalar pass over that block.
 *
 * Exactness: a token is drawn with its weight's share of the total, the weights within 2 ulp of
 * expf's and summed in double (over float partial sums of blocks), so the draw follows p to
 * float rounding, as the race does. A token of weight 0 (logit -inf, or below min_p) is never
 * drawn. Rows the softmax is undefined for (a NaN, an infinite maximum, every logit -inf) give
 * token 0, what torch's softmax and race give them (every probability NaN; argmax's first).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { SUM_BLOCK = 1024, MAX_BLOCKS = 1024 };

/* Token i's weight in a row of maximum `top`: exp((x - top) / T), 0 below min_p (a weight is
 * p_i / p_max, so the min_p rule p_i < min_p * p_max is weight < min_p). */
static inline float weight_of(float x, float top, float inv_temperature, float min_p) {
    const float w = exp_nonpositive((x - top) * inv_temperature);
    return w < min_p ? 0.0f : w;
}

/* The first token whose cumulative weight exceeds `target`, within [lo, hi); the block's last
 * token of positive weight where rounding leaves the target unreached (-1: none in the block). */
static int64_t walk_block(const float *x, int64_t lo, int64_t hi, float top, float inv_temperature, float min_p, double cum,
                          double target) {
    int64_t last = -1;
    for (int64_t i = lo; i < hi; i++) {
        const float w = weight_of(x[i], top, inv_temperature, min_p);
        if (w <= 0.0f) continue;
        cum += w;
        last = i;
        if (cum > target) return i;
    }
    return last;
}

/* The end of block b (of `block` tokens; the last one ends at the vocabulary's end). */
static inline int64_t block_end(int64_t b, int64_t block, int64_t vocab) {
    return b * block + block < vocab ? b * block + block : vocab;
}

int64_t categorical_row(const float *x, int64_t vocab, float inv_temperature, float min_p, double u) {
    int nan;
    const float top = row_max(x, vocab, &nan);
    if (nan || isinf(top)) return 0;
    /* blocks of at least SUM_BLOCK tokens, at most MAX_BLOCKS of them (any vocabulary's sums fit the stack) */
    const int64_t block = vocab <= (int64_t)SUM_BLOCK * MAX_BLOCKS ? SUM_BLOCK : (vocab + MAX_BLOCKS - 1) / MAX_BLOCKS;
    const int64_t blocks = (vocab + block - 1) / block;
    float part[MAX_BLOCKS];
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * block, hi = block_end(b, block, vocab);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = lo; i < hi; i++) sum += weight_of(x[i], top, inv_temperature, min_p);
        part[b] = sum;
        total += sum;
    }
    /* u < 1, so the target lies below the total; the walk's sums round as the total's did but
     * within a block, where the scalar pass may fall short of the vector sum: its last token */
    const double target = u * total;
    double cum = 0.0;
    int64_t last = 0;
    for (int64_t b = 0; b < blocks; b++) {
        if (part[b] <= 0.0f) continue;
        if (cum + part[b] > target) {
            const int64_t found = walk_block(x, b * block, block_end(b, block, vocab), top, inv_temperature, min_p, cum, target);
            if (found >= 0) return found;
        }
        cum += part[b];
        last = b;
    }
    /* the target at or past the total by rounding: the last token of positive weight */
    const int64_t found = walk_block(x, last * block, block_end(last, block, vocab), top, inv_temperature, min_p, 0.0, INFINITY);
    return found >= 0 ? found : 0;
}

/* x, unchanged, as a value the compiler cannot see through: a division by it stays a division.
 * Under -ffast-math GCC rewrites x[i] / t in a loop as x[i] * (1 / t), which rounds differently
 * from torch's `logits / temperature`; a filtered row must be the one the sampler's tensors gave. */
static inline vf opaque(vf t) {
#if defined(__AVX__)
    __asm__("" : "+v"(t));
#else
    __asm__("" : "+m"(t));
#endif
    return t;
}

/* y = x / t element by element, each quotient rounded as IEEE division rounds it. */
static void divide_row(const float *x, int64_t n, float t, float *y) {
    const vf divisor = (vf){0} + t;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) storev(y + i, loadv(x + i) / opaque(divisor));
    if (i < n) { /* the tail in one vector, its unused lanes 1 / t */
        vf tail = (vf){0} + 1.0f;
        memcpy(&tail, x + i, sizeof(float) * (size_t)(n - i));
        tail = tail / opaque(divisor);
        memcpy(y + i, &tail, sizeof(float) * (size_t)(n - i));
    }
}

int64_t draw_row(const float *x, int64_t vocab, RowDraw d, double u, float *scratch) {
    if (!draw_filters(d, vocab)) return categorical_row(x, vocab, d.inv_temperature, d.min_p, u);
    divide_row(x, vocab, d.temperature, scratch);
    nucleus_row(scratch, vocab, d.top_k, d.top_p, (uint32_t *)(scratch + vocab));
    return categorical_row(scratch, vocab, 1.0f, d.min_p, u);
}

int check_row_draw(RowDraw d, int64_t vocab, const char *what, int64_t i) {
    REQUIRE(d.inv_temperature > 0.0f && isfinite(d.inv_temperature), "%s %lld at 1 / temperature %g", what, (long long)i,
            (double)d.inv_temperature);
    REQUIRE(d.min_p >= 0.0f && d.min_p <= 1.0f, "%s %lld with min_p %g", what, (long long)i, (double)d.min_p);
    REQUIRE(d.top_k >= 1 && d.top_p > 0.0f && d.top_p <= 1.0f, "%s %lld with top_k %lld, top_p %g", what, (long long)i,
            (long long)d.top_k, (double)d.top_p);
    REQUIRE(!draw_filters(d, vocab) || (d.temperature > 0.0f && isfinite(d.temperature)),
            "%s %lld filtered (top_k %lld, top_p %g) at temperature %g", what, (long long)i, (long long)d.top_k,
            (double)d.top_p, (double)d.temperature);
    return KERNEL_OK;
}

/* The exported kernel (the sampler's random rows on the CPU): draw i samples row row_of[i] of
 * `logits` (`rows` rows of `vocab` floats within `logits_capacity`) by draw_row's rule — its
 * 1 / temperature, temperature, min_p, top_k and top_p (the last three may be NULL: off for every
 * draw; temperature NULL where no draw filters) — and uniform[i] in [0, 1), into tokens[i]
 * (`count` draws within `out_capacity`). Draws are shared among `num_threads` threads, each by
 * one thread (its token depends on its row, its rule and its number alone). */
int sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, const int64_t *row_of,
                const float *inv_temperature, const float *temperature, const float *min_p, const int64_t *top_k,
                const float *top_p, const double *uniform, int64_t count, int64_t *tokens, int64_t out_capacity, int num_threads) {
    REQUIRE(rows >= 0 && vocab >= 1 && rows <= logits_capacity / vocab && count >= 0 && count <= out_capacity && num_threads >= 1,
            "sample rows: %lld rows of %lld logits do not fit %lld floats, or %lld draws %lld outputs (%d threads)", (long long)rows,
            (long long)vocab, (long long)logits_capacity, (long long)count, (long long)out_capacity, num_threads);
    int filters = 0;
    for (int64_t i = 0; i < count; i++) {
        REQUIRE(row_of[i] >= 0 && row_of[i] < rows, "sample rows: draw %lld reads row %lld of %lld", (long long)i,
                (long long)row_of[i], (long long)rows);
        const RowDraw d = row_draw(inv_temperature, temperature, min_p, top_k, top_p, i);
        const int status = check_row_draw(d, vocab, "sample rows: draw", i);
        if (status) return status;
        REQUIRE(uniform[i] >= 0.0 && uniform[i] < 1.0, "sample rows: draw %lld of uniform %g, outside [0, 1)", (long long)i,
                uniform[i]);
        filters |= draw_filters(d, vocab);
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (count > 1) reduction(| : failed)
    {
        float *scratch = filters ? malloc(sizeof(float) * DRAW_SCRATCH * (size_t)vocab) : NULL;
        failed |= filters && scratch == NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++)
            if (!filters || scratch != NULL)
                tokens[i] = draw_row(logits + row_of[i] * vocab, vocab, row_draw(inv_temperature, temperature, min_p, top_k, top_p, i),
                                     uniform[i], scratch);
        free(scratch);
    }
    return failed ? KERNEL_NO_MEMORY : KERNEL_OK;
}
