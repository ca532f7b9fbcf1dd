/* Greedy speculative decoding with a draft model, whole cycles in one call: the draft proposes
 * up to k tokens (k one-row passes after catching up), the target scores the newest token and
 * the proposals in one step of k + 1 rows, and the longest prefix of proposals equal to the
 * target's argmaxes is kept, followed by the target's own token at the first difference (or
 * after the last proposal). The tokens are exactly those of greedy decoding without speculation:
 * every target row is a decode row attending to the context up to its own position, and the
 * fused step's results do not depend on the other rows of the step.
 *
 * Why in one call: on a small model a decode step is a fraction of a millisecond, and the
 * engine's own per-step work (scheduling, staging every pass's metadata, sampling, bookkeeping)
 * costs as much as the step. Proposing and verifying through the engine takes k + 1 passes and
 * a verification's bookkeeping per cycle, so a draft only paid for itself where a target step
 * costs milliseconds. Here a cycle is k + 1 fused steps and a few integer comparisons.
 *
 * Both models' KV live in blocks with the same ids (a draft's pool mirrors the target's), so one
 * block table per sequence addresses both. Per sequence the call tracks the newest token's
 * position (the target's KV is valid below it) and the draft's own frontier: the draft has
 * computed KV for the inputs it was fed that the target then accepted, and catches up on the
 * rest (one or two tokens after a cycle, or the history it was given) in its first pass.
 *
 * A proposal the draft itself gives less than `min_log_prob` (llama.cpp's draft p-min) ends the
 * sequence's proposals for the cycle, unproposed: a token the draft is unsure of is seldom
 * accepted, and each proposal costs a draft pass and a verification row whether or not it is.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "decode_step.h"

/* The rows of one fused step, built up row by row. */
typedef struct {
    int64_t *ids, *pos, *slots, *lens, *tables, *logit_rows;
    float *logits;
    int64_t rows, num_logits, max_blocks, block_size, logits_capacity;
} Rows;

static void add_row(Rows *b, const int64_t *table, int64_t token, int64_t position, int logit) {
    const int64_t r = b->rows++;
    b->ids[r] = token;
    b->pos[r] = position;
    b->lens[r] = position + 1;
    b->slots[r] = slot_of(table, position, b->block_size);
    memcpy(b->tables + r * b->max_blocks, table, sizeof(int64_t) * b->max_blocks);
    if (logit) b->logit_rows[b->num_logits++] = r;
}

static Step step_of(const Rows *b) {
    return (Step){b->rows,   b->ids,        b->pos,    b->slots,          b->lens, b->tables, b->max_blocks, b->logit_rows,
                  b->num_logits, b->logits, b->logits_capacity};
}

/* Runs the rows on `md` and writes each logit row's argmax (mapped through `vocab`) to out. */
static int run_rows(const Model *md, Rows *b, int threads, const int64_t *vocab, int64_t *out, float *logprobs) {
    const Step st = step_of(b);
    const int failed = decode_step(md, &st, threads);
    if (failed) return failed;
    argmax_rows(b->logits, b->num_logits, md->vocab, out, logprobs);
    if (vocab != NULL)
        for (int64_t i = 0; i < b->num_logits; i++) out[i] = vocab[out[i]];
    return KERNEL_OK;
}

typedef struct {
    const Speculation *sp;
    const int64_t *first_pos, *first_draft; /* position and draft_position at entry */
} Known;

/* The token at position p of sequence s: from the history given, or produced here. */
static int64_t token_at(const Known *kn, int64_t s, int64_t p) {
    const Speculation *sp = kn->sp;
    if (p <= kn->first_pos[s]) return sp->history[s * sp->history_ld + (p - kn->first_draft[s])];
    return sp->tokens[s * sp->out_ld + (p - kn->first_pos[s] - 1)];
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The draft's passes of one cycle: proposals d[s * k + j] for the sequences with kk[s] > j. A
 * proposal below the draft's confidence floor lowers kk[s] to the proposals before it. fed[s]:
 * how many proposals the draft was fed (computed KV for), kk[s] - 1 or, after an early stop, kk[s]. */
static int propose(const Model *draft, const Known *kn, int64_t *kk, int64_t *fed, Rows *b, int threads, int64_t *d,
                   int64_t *scratch, float *lp) {
    const Speculation *sp = kn->sp;
    const int64_t S = sp->num_seqs, k = sp->k;
    for (int64_t j = 0; j < k; j++) {
        b->rows = b->num_logits = 0;
        for (int64_t s = 0; s < S; s++) {
            if (kk[s] <= j) continue;
            const int64_t *table = sp->block_tables + s * sp->max_blocks, pos = sp->position[s];
            if (j == 0) { /* catch up on what the draft has not seen, through the newest token */
                for (int64_t p = sp->draft_position[s]; p <= pos; p++) add_row(b, table, token_at(kn, s, p), p, p == pos);
            } else {
                add_row(b, table, d[s * k + j - 1], pos + j, 1);
            }
        }
        if (b->rows == 0) break;
        const int failed = run_rows(draft, b, threads, sp->draft_vocab, scratch, lp);
        if (failed) return failed;
        for (int64_t s = 0, i = 0; s < S; s++) {
            if (kk[s] <= j) continue;
            fed[s] = j;
            if (lp[i] < sp->min_log_prob) kk[s] = j; /* unsure: this one and the rest go unproposed */
            d[s * k + j] = scratch[i++];
        }
    }
    return KERNEL_OK;
}

/* The target's verification of one cycle, and the tokens it yields. */
static int verify(const Model *target, const Known *kn, const int64_t *kk, const int64_t *fed, Rows *b, int threads,
                  const int64_t *d, int64_t *argmax, float *lp, int64_t cycle, int64_t num_cycles) {
    const Speculation *sp = kn->sp;
    const int64_t S = sp->num_seqs, k = sp->k;
    b->rows = b->num_logits = 0;
    for (int64_t s = 0; s < S; s++) {
        if (kk[s] < 0) continue;
        const int64_t *table = sp->block_tables + s * sp->max_blocks, pos = sp->position[s];
        add_row(b, table, token_at(kn, s, pos), pos, 1);
        for (int64_t j = 0; j < kk[s]; j++) add_row(b, table, d[s * k + j], pos + 1 + j, 1);
    }
    const int failed = run_rows(target, b, threads, NULL, argmax, lp);
    if (failed) return failed;
    for (int64_t s = 0, first = 0; s < S; s++) {
        if (kk[s] < 0) continue;
        int64_t m = 0;
        while (m < kk[s] && d[s * k + m] == argmax[first + m]) m++;
        int64_t *out = sp->tokens + s * sp->out_ld + sp->num_tokens[s];
        float *out_lp = sp->logprobs + s * sp->out_ld + sp->num_tokens[s];
        for (int64_t j = 0; j <= m; j++) out[j] = argmax[first + j], out_lp[j] = lp[first + j];
        sp->num_tokens[s] += m + 1;
        sp->proposed[s * num_cycles + cycle] = kk[s];
        sp->accepted[s * num_cycles + cycle] = m;
        /* the draft's KV is right for the inputs it was fed (the newest token, then proposals
         * 1 .. fed) that the target kept */
        if (fed[s] >= 0) sp->draft_position[s] = sp->position[s] + min64(m, fed[s]) + 1;
        sp->position[s] += m + 1;
        first += kk[s] + 1;
    }
    return KERNEL_OK;
}

/* What speculate_greedy is given, checked before it runs: both models, and per sequence a block
 * table that covers its capacity within both pools (and the rotary tables), a budget that fits
 * its output row, a history that reaches the newest token; draft logit columns that map to
 * target tokens. The steps it runs check their own rows too (decode_step). */
static int check_speculation(const Model *target, const Model *draft, const Speculation *sp, int64_t num_cycles) {
    int status = check_model(target);
    if (!status) status = check_model(draft);
    if (status) return status;
    const int64_t bs = target->block_size;
    const int64_t blocks = target->num_blocks < draft->num_blocks ? target->num_blocks : draft->num_blocks;
    const int64_t positions = target->max_position < draft->max_position ? target->max_position : draft->max_position;
    REQUIRE(sp->num_seqs >= 0 && sp->k >= 0 && num_cycles >= 0 && sp->max_blocks >= 0 && sp->history_ld >= 1 && sp->out_ld >= 0 &&
                draft->block_size == bs,
            "fused speculation: %lld sequences, k %lld, %lld cycles, history of %lld, block sizes %lld / %lld",
            (long long)sp->num_seqs, (long long)sp->k, (long long)num_cycles, (long long)sp->history_ld, (long long)bs,
            (long long)draft->block_size);
    for (int64_t s = 0; s < sp->num_seqs; s++) {
        const int64_t behind = sp->position[s] - sp->draft_position[s] + 1;
        REQUIRE(sp->draft_position[s] >= 0 && behind >= 1 && behind <= sp->history_ld,
                "fused speculation: sequence %lld's history must reach from its draft position %lld to its newest token %lld",
                (long long)s, (long long)sp->draft_position[s], (long long)sp->position[s]);
        REQUIRE(sp->budget[s] >= 0 && sp->budget[s] <= sp->out_ld, "fused speculation: sequence %lld's budget %lld, rows of %lld",
                (long long)s, (long long)sp->budget[s], (long long)sp->out_ld);
        /* a cycle's rows stay below both its capacity and the position its budget reaches */
        const int64_t reach = min64(sp->capacity[s], sp->position[s] + sp->budget[s]);
        REQUIRE(reach <= positions, "fused speculation: sequence %lld reaches position %lld, past the rotary tables' %lld",
                (long long)s, (long long)reach, (long long)positions);
        status = check_table(sp->block_tables + s * sp->max_blocks, sp->max_blocks, reach, bs, blocks,
                             "fused speculation: sequence", s);
        if (status) return status;
    }
    if (sp->draft_vocab != NULL)
        for (int64_t i = 0; i < draft->vocab; i++)
            REQUIRE(sp->draft_vocab[i] >= 0 && sp->draft_vocab[i] < target->vocab,
                    "fused speculation: draft column %lld maps to token %lld, the target's vocab is %lld", (long long)i,
                    (long long)sp->draft_vocab[i], (long long)target->vocab);
    return KERNEL_OK;
}

/* Up to num_cycles cycles; cycle c runs the target on threads[2c] threads and the draft on
 * threads[2c + 1], and their times go to seconds[2c] and seconds[2c + 1]. A sequence stops when
 * it has produced its budget or its block table is full. Returns KERNEL_OK, KERNEL_NO_MEMORY,
 * KERNEL_BAD_SHAPE (an unsupported head shape) or KERNEL_REFUSED (check_speculation). */
int speculate_greedy(const Model *target, const Model *draft, Speculation *sp, int64_t num_cycles, const int *threads,
                     double *seconds) {
    const int64_t S = sp->num_seqs, k = sp->k, B = sp->max_blocks;
    const int status = check_speculation(target, draft, sp, num_cycles);
    if (status) return status;
    int64_t lag = 1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t behind = sp->position[s] - sp->draft_position[s] + 1;
        lag = behind > lag ? behind : lag;
        sp->num_tokens[s] = 0;
        for (int64_t c = 0; c < num_cycles; c++) sp->proposed[s * num_cycles + c] = sp->accepted[s * num_cycles + c] = -1;
    }
    for (int64_t c = 0; c < 2 * num_cycles; c++) seconds[c] = 0.0;
    /* a pass has at most max_rows rows, of which at most max_logits score (a verification's) */
    const int64_t max_rows = S * (lag > k + 1 ? lag : k + 1), max_logits = S * (k + 1);
    const int64_t vocab = target->vocab > draft->vocab ? target->vocab : draft->vocab;
    int64_t *ints = malloc(sizeof(int64_t) * (max_rows * (5 + B) + 2 * S + S * k + 2 * max_logits));
    float *floats = malloc(sizeof(float) * (max_logits * vocab + max_logits));
    int64_t *first = malloc(sizeof(int64_t) * 2 * S);
    if (ints == NULL || floats == NULL || first == NULL) {
        free(ints), free(floats), free(first);
        return KERNEL_NO_MEMORY;
    }
    Rows b = {ints, ints + max_rows, ints + 2 * max_rows, ints + 3 * max_rows, ints + 5 * max_rows, ints + 4 * max_rows,
              floats, 0, 0, B, target->block_size, max_logits * vocab};
    int64_t *kk = ints + max_rows * (5 + B), *fed = kk + S, *d = fed + S, *argmax = d + S * k, *scratch = argmax + max_logits;
    float *lp = floats + max_logits * vocab;
    memcpy(first, sp->position, sizeof(int64_t) * S);
    memcpy(first + S, sp->draft_position, sizeof(int64_t) * S);
    const Known kn = {sp, first, first + S};
    int failed = 0;
    for (int64_t c = 0; c < num_cycles && !failed; c++) {
        int active = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t left = sp->budget[s] - sp->num_tokens[s], room = sp->capacity[s] - sp->position[s];
            kk[s] = left > 0 && room > 0 ? min64(k, min64(left, room) - 1) : -1;
            fed[s] = -1; /* the draft saw nothing of this cycle yet */
            active |= kk[s] >= 0;
        }
        if (!active) break;
        double start = omp_get_wtime();
        failed = propose(draft, &kn, kk, fed, &b, threads[2 * c + 1], d, scratch, lp);
        seconds[2 * c + 1] = omp_get_wtime() - start;
        if (failed) break;
        start = omp_get_wtime();
        failed = verify(target, &kn, kk, fed, &b, threads[2 * c], d, argmax, lp, c, num_cycles);
        seconds[2 * c] = omp_get_wtime() - start;
    }
    free(ints), free(floats), free(first);
    return failed;
}
