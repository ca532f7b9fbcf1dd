/* Greedy sampling of a few rows of logits: each row's argmax and its log-probability; and the
 * log-probability of a token drawn otherwise (token_logprobs).
 *
 * Why in C: for a small decode step the sampler's torch ops (argmax, gather, logsumexp) each
 * pay a dispatch and an OpenMP fork over the whole vocabulary, which on a 49k vocabulary took
 * as long as a tenth of a single-stream step's weight reads. Here a row is three vector passes
 * over logits that are still in L2: the maximum (and whether any logit is NaN), the first index
 * holding it, and sum(exp(x - max)); the chosen token's log-probability is then
 * max - logsumexp = -log(sum).
 *
 * Ties and NaN follow torch.argmax: the first maximal index wins, and a NaN counts as the
 * maximum (its row's log-probability is NaN). A row whose maximum is infinite also gets NaN,
 * as torch's max - logsumexp does.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

enum { SUM_BLOCK = 1024, SEARCH_BLOCK = 64 };

/* sum(exp(x - top)) over a row of maximum `top`: a double sum of float partial sums over blocks,
 * so rounding does not grow with the vocabulary. */
static double exp_sum(const float *x, int64_t vocab, float top) {
    double sum = 0.0;
    for (int64_t lo = 0; lo < vocab; lo += SUM_BLOCK) {
        const int64_t hi = lo + SUM_BLOCK < vocab ? lo + SUM_BLOCK : vocab;
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int64_t i = lo; i < hi; i++) part += exp_nonpositive(x[i] - top);
        sum += part;
    }
    return sum;
}

static void greedy_row(const float *x, int64_t vocab, int64_t *token, float *logprob) {
    int nan;
    const float top = row_max(x, vocab, &nan);
    int64_t at = 0;
    if (nan) {
        while (x[at] == x[at]) at++;
        *token = at;
        *logprob = NAN;
        return;
    }
    /* the first index holding the maximum: blocks compared whole (vectorised), then the block that has it */
    while (at + SEARCH_BLOCK <= vocab) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = at; i < at + SEARCH_BLOCK; i++) hit |= x[i] == top;
        if (hit) break;
        at += SEARCH_BLOCK;
    }
    while (at < vocab - 1 && x[at] != top) at++;
    *token = at;
    *logprob = isinf(top) ? NAN : (float)-log(exp_sum(x, vocab, top));
}

float token_logprob(const float *x, int64_t vocab, int64_t token) {
    int nan;
    const float top = row_max(x, vocab, &nan);
    return nan || isinf(top) ? NAN : (float)((x[token] - top) - log(exp_sum(x, vocab, top)));
}

void argmax_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *tokens, float *logprobs) {
    for (int64_t r = 0; r < rows; r++) greedy_row(logits + r * vocab, vocab, tokens + r, logprobs + r);
}

/* The exported kernel (the sampler's greedy rows): `logits_capacity` floats at logits,
 * `out_capacity` entries at tokens and at logprobs. Rows are shared among `num_threads`
 * threads (each row by one thread, so its result does not depend on the others): a batch of
 * 64 rows of a 49k vocabulary is 12.6 MB of logits, where torch's argmax and logsumexp took
 * ~2.6 and ~1.9 ms a step on 2 cores. */
int greedy_rows(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, int64_t *tokens, float *logprobs,
                int64_t out_capacity, int num_threads) {
    REQUIRE(rows >= 0 && vocab >= 1 && rows <= out_capacity && rows <= logits_capacity / vocab && num_threads >= 1,
            "greedy rows: %lld rows of %lld logits do not fit %lld floats, or %lld outputs (%d threads)", (long long)rows,
            (long long)vocab, (long long)logits_capacity, (long long)out_capacity, num_threads);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) argmax_rows(logits + r * vocab, 1, vocab, tokens + r, logprobs + r);
    return KERNEL_OK;
}

/* Row r's log-probability of tokens[r] (a token below 0: of token 0, a value the caller drops),
 * x[t] - max - log(sum(exp(x - max))): what torch's log_softmax holds there, NaN for a row with a
 * NaN or an infinite maximum; `rows` rows within logits_capacity floats and out_capacity
 * entries, shared among num_threads threads. The sampler's random rows: their chosen tokens'
 * log-probabilities without writing a log-softmax of every row. */
int token_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, const int64_t *tokens,
                   float *logprobs, int64_t out_capacity, int num_threads) {
    REQUIRE(rows >= 0 && vocab >= 1 && rows <= out_capacity && rows <= logits_capacity / vocab && num_threads >= 1,
            "token logprobs: %lld rows of %lld logits do not fit %lld floats, or %lld outputs (%d threads)", (long long)rows,
            (long long)vocab, (long long)logits_capacity, (long long)out_capacity, num_threads);
    for (int64_t r = 0; r < rows; r++)
        REQUIRE(tokens[r] < vocab, "token logprobs: row %lld's token %lld of a %lld-token vocabulary", (long long)r,
                (long long)tokens[r], (long long)vocab);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) logprobs[r] = token_logprob(logits + r * vocab, vocab, tokens[r] < 0 ? 0 : tokens[r]);
    return KERNEL_OK;
}
