/* Top-k and top-p (nucleus) filtering of rows of logits without sorting them: each row's
 * threshold, the smallest logit it keeps, and the row with every logit below it set to -inf.
 *
 * Why in C: the sampler found the k-th largest logit and the nucleus by sorting the whole row, and
 * torch's sort of a 49k-token row took 4.0 ms on a Zen 3 (a single-stream decode step is ~5 ms):
 * temperature-0.7 chat with top_p 0.9 decoded at 79 tok/s where greedy ran 161. Neither filter needs
 * the order of the row, only one value of it, so both are a radix selection: each logit's bits as
 * an unsigned key that orders like the float, and three passes that each fix the next 11, 11 and
 * 10 bits of the wanted key from a histogram of the keys that share the bits fixed so far.
 *
 * - top-k: the k-th largest logit is the largest key t with at least k keys >= t (a histogram of
 *   counts). The same value as the sorted row's k-th entry, so the same tokens are kept.
 * - top-p: the sort kept token i (in descending order) while the probability mass before it was
 *   below p, which keeps exactly the logits >= v, v the largest value whose tokens at or above it
 *   hold at least p of the mass (a histogram of exp(x - max) weights, over the tokens top-k kept).
 *   Ties at v are all kept (the sort kept an arbitrary share of them), and the masses are summed
 *   in another order than torch's cumsum, so a token whose mass before it lies within rounding of p
 *   may fall the other way.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { LEVELS = 3, MAX_BUCKETS = 2048 };
static const int LEVEL_SHIFT[LEVELS] = {21, 10, 0}; /* bits 31-21, 20-10, 9-0 */

/* A float's bits as a key in the float's order (-0 just below +0); NaN is kept out by the caller. */
static inline uint32_t key_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

static inline float value_of(uint32_t key) {
    const uint32_t u = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* The scratch space of one row: its keys and weights, and the candidates a selection narrows
 * them to (the keys that share the bits fixed so far, with their weights). */
typedef struct {
    uint32_t *keys, *candidate_keys;
    float *weights, *candidate_weights;
} Scratch;

/* The largest key t such that the weights of the keys >= t sum to at least `target` (a weight of
 * 1 each without weights). After the first pass only the keys of the chosen bucket are looked at
 * again: logits crowd into few buckets of the first 11 bits, but the next ones spread them out.
 * Returns 0 when no key reaches the target (rounding with a target at the total). */
static int select_key(const Scratch *s, int64_t n, int weighted, double target, uint32_t *found) {
    double histogram[2][MAX_BUCKETS], above = 0.0; /* two copies: consecutive keys that share a bucket do not wait on each other */
    const uint32_t *keys = s->keys;
    const float *weights = s->weights;
    uint32_t prefix = 0;
    for (int level = 0; level < LEVELS; level++) {
        const int shift = LEVEL_SHIFT[level], buckets = 1 << ((level ? LEVEL_SHIFT[level - 1] : 32) - shift);
        const uint32_t mask = (uint32_t)(buckets - 1);
        memset(histogram, 0, sizeof histogram);
        for (int64_t i = 0; i < n; i++) histogram[i & 1][(keys[i] >> shift) & mask] += weighted ? weights[i] : 1.0;
        int b = buckets - 1;
        while (b >= 0 && above + histogram[0][b] + histogram[1][b] < target) above += histogram[0][b] + histogram[1][b], b--;
        if (b < 0) return 0;
        prefix |= (uint32_t)b << shift;
        int64_t kept = 0; /* the chosen bucket's keys (and weights) become the candidates */
        for (int64_t i = 0; i < n; i++)
            if (((keys[i] >> shift) & mask) == (uint32_t)b) {
                s->candidate_keys[kept] = keys[i];
                if (weighted) s->candidate_weights[kept] = weights[i];
                kept++;
            }
        keys = s->candidate_keys, weights = s->candidate_weights, n = kept;
    }
    *found = prefix;
    return 1;
}

/* One row's threshold (-inf: nothing filtered); keys and weights are the row's scratch space. */
static float row_threshold(const float *x, int64_t vocab, int64_t top_k, float top_p, const Scratch *s) {
    int nan;
    const float top = row_max(x, vocab, &nan);
    if (nan || !isfinite(top) || (top_k >= vocab && top_p >= 1.0f)) return -INFINITY; /* NaN, inf: torch's softmax is NaN */
    for (int64_t i = 0; i < vocab; i++) s->keys[i] = key_of(x[i]);
    float threshold = -INFINITY;
    uint32_t key;
    if (top_k < vocab && select_key(s, vocab, 0, (double)(top_k < 1 ? 1 : top_k), &key)) threshold = value_of(key);
    if (top_p < 1.0f) {
        double mass = 0.0;
        for (int64_t i = 0; i < vocab; i++) {
            s->weights[i] = x[i] >= threshold ? exp_nonpositive(x[i] - top) : 0.0f;
            mass += s->weights[i];
        }
        /* a positive target: the most likely token is always kept */
        if (select_key(s, vocab, 1, fmax((double)top_p * mass, DBL_MIN), &key) && value_of(key) > threshold) threshold = value_of(key);
    }
    return threshold;
}

/* A row's scratch space from NUCLEUS_SCRATCH * vocab 32-bit words at `words`. */
static Scratch scratch_in(uint32_t *words, int64_t vocab) {
    return (Scratch){words, words + vocab, (float *)(words + 2 * vocab), (float *)(words + 3 * vocab)};
}

/* x's logits below the threshold of top_k and top_p as -inf, into y (which may be x). */
static void filter_row(const float *x, float *y, int64_t vocab, int64_t top_k, float top_p, const Scratch *s) {
    const float threshold = row_threshold(x, vocab, top_k, top_p, s);
#pragma omp simd
    for (int64_t i = 0; i < vocab; i++) y[i] = x[i] < threshold ? -INFINITY : x[i];
}

void nucleus_row(float *x, int64_t vocab, int64_t top_k, float top_p, uint32_t *scratch) {
    const Scratch s = scratch_in(scratch, vocab);
    filter_row(x, x, vocab, top_k, top_p, &s);
}

/* The exported kernel (the sampler's top-k / top-p): `rows` rows of `vocab` logits (within
 * `logits_capacity` floats) written to `out` (within `out_capacity` floats; it may be `logits`)
 * with the logits below each row's threshold set to -inf. top_k (>= vocab: off) or top_p (>= 1:
 * off) may be NULL where no row uses it. Rows are shared among `num_threads` threads. */
int nucleus_filter(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, const int64_t *top_k,
                   const float *top_p, float *out, int64_t out_capacity, int num_threads) {
    REQUIRE(rows >= 0 && vocab >= 1 && rows <= logits_capacity / vocab && rows <= out_capacity / vocab && num_threads >= 1,
            "nucleus filter: %lld rows of %lld logits do not fit %lld floats in or %lld out (%d threads)", (long long)rows,
            (long long)vocab, (long long)logits_capacity, (long long)out_capacity, num_threads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows > 1) reduction(| : failed)
    {
        uint32_t *words = malloc((size_t)vocab * NUCLEUS_SCRATCH * sizeof(uint32_t));
        failed |= words == NULL;
        const Scratch s = scratch_in(words, vocab);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (words != NULL)
                filter_row(logits + r * vocab, out + r * vocab, vocab, top_k ? top_k[r] : INT64_MAX, top_p ? top_p[r] : 1.0f, &s);
        free(words);
    }
    return failed ? KERNEL_NO_MEMORY : KERNEL_OK;
}
