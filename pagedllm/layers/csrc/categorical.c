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

/* The exported kernel (the sampler's random rows on the CPU): draw i samples row row_of[i] of
 * `logits` (`rows` rows of `vocab` floats within `logits_capacity`) at 1 / inv_temperature[i],
 * min_p[i] (0: off; min_p may be NULL: off for all) and uniform[i] in [0, 1), into tokens[i]
 * (`count` draws within `out_capacity`). Draws are shared among `num_threads` threads, each by
 * one thread (its token depends on its row and number alone). */
int sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, const int64_t *row_of,
                const float *inv_temperature, const float *min_p, const double *uniform, int64_t count, int64_t *tokens,
                int64_t out_capacity, int num_threads) {
    REQUIRE(rows >= 0 && vocab >= 1 && rows <= logits_capacity / vocab && count >= 0 && count <= out_capacity && num_threads >= 1,
            "sample rows: %lld rows of %lld logits do not fit %lld floats, or %lld draws %lld outputs (%d threads)", (long long)rows,
            (long long)vocab, (long long)logits_capacity, (long long)count, (long long)out_capacity, num_threads);
    for (int64_t i = 0; i < count; i++) {
        REQUIRE(row_of[i] >= 0 && row_of[i] < rows, "sample rows: draw %lld reads row %lld of %lld", (long long)i,
                (long long)row_of[i], (long long)rows);
        REQUIRE(inv_temperature[i] > 0.0f && isfinite(inv_temperature[i]), "sample rows: draw %lld at 1 / temperature %g",
                (long long)i, (double)inv_temperature[i]);
        REQUIRE(min_p == NULL || (min_p[i] >= 0.0f && min_p[i] <= 1.0f), "sample rows: draw %lld with min_p %g", (long long)i,
                (double)min_p[i]);
        REQUIRE(uniform[i] >= 0.0 && uniform[i] < 1.0, "sample rows: draw %lld of uniform %g, outside [0, 1)", (long long)i,
                uniform[i]);
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count > 1)
    for (int64_t i = 0; i < count; i++)
        tokens[i] = categorical_row(logits + row_of[i] * vocab, vocab, inv_temperature[i], min_p ? min_p[i] : 0.0f, uniform[i]);
    return KERNEL_OK;
}
