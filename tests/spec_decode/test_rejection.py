"""Rejection sampling against its promise: whatever the proposer's q, emitted tokens follow p."""
from __future__ import annotations

import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.spec_decode.rejection import VerifyBatch, VerifySpan, rejection_sample

CPU = torch.device("cpu")
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}  # chi-square critical values, p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def one_proposal_batch(num: int, proposals: torch.Tensor, draft_probs: torch.Tensor | None, greedy: bool = False) -> VerifyBatch:
    """`num` sequences, each verifying one proposal: rows 2s (the proposal) and 2s+1 (bonus)."""
    spans = [VerifySpan(2 * s, 1, greedy, None, draft_probs) for s in range(num)]
    rows = torch.stack([proposals, torch.full_like(proposals, -1)], dim=1).reshape(-1)
    return VerifyBatch(spans, rows, torch.arange(num).repeat_interleave(2), torch.tensor([0, 1]).repeat(num),
                       torch.arange(0, 2 * num, 2), torch.full((num,), not greedy))


def random_meta(rows: int) -> SamplingMetadata:
    return SamplingMetadata(rows, random_rows=torch.arange(rows), temperature=torch.ones(rows), unseeded=torch.arange(rows))


def test_first_token_follows_the_target_whatever_the_draft():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])  # a poor draft: rejection and residual do the work
    num = 20000
    gen = torch.Generator().manual_seed(0)
    proposals = torch.multinomial(q, num, replacement=True, generator=gen)
    logits = torch.stack([p.log(), torch.tensor([0.25] * 4).log()]).repeat(num, 1)
    batch = one_proposal_batch(num, proposals, q.unsqueeze(0))
    out = rejection_sample(Sampler(1, CPU), logits, random_meta(2 * num), batch)
    first = out.token_ids.view(num, 2)[:, 0]
    assert chi2(torch.bincount(first, minlength=4).float(), p) < CHI2_999[3]
    accepted = (first == proposals).float().mean()
    assert abs(float(accepted) - float(torch.minimum(p, q).sum())) < 0.02  # acceptance = sum min(p, q)


def test_one_hot_proposals_are_kept_with_the_target_probability():
    """n-gram proposals (q one-hot): token d kept with probability p(d), else a draw from p minus d."""
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    num = 20000
    proposals = torch.full((num,), 1)
    logits = torch.stack([p.log(), p.log()]).repeat(num, 1)
    out = rejection_sample(Sampler(2, CPU), logits, random_meta(2 * num), one_proposal_batch(num, proposals, None))
    tokens = out.token_ids.view(num, 2)
    assert chi2(torch.bincount(tokens[:, 0], minlength=4).float(), p) < CHI2_999[3]
    # after an accepted proposal the bonus row emits a token too; after a rejection it emits none
    assert bool(((tokens[:, 0] == 1) == (tokens[:, 1] >= 0)).all())


def test_greedy_keeps_proposals_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    # one sequence, three proposals: 1 (argmax: kept), 0 (argmax: kept), 1 (argmax is 2: rejected)
    batch = VerifyBatch([VerifySpan(0, 3, True)], torch.tensor([1, 0, 1, -1]), torch.zeros(4, dtype=torch.long),
                        torch.arange(4), torch.tensor([0]), torch.tensor([False]))
    out = rejection_sample(Sampler(0, CPU), logits, SamplingMetadata(4), batch)
    assert out.token_ids.tolist() == [1, 0, 2, -1]


# ---- cases found by mutation testing (issue 45, `make mutate`) --------------------------------------
VOCAB = 4000


def mixed_batch(span_seed: int, draft_probs: torch.Tensor | None = None) -> VerifyBatch:
    """Three spans of two proposals and a bonus row: greedy (rows 0-2), random on the engine's
    generator (3-5), random on its own seeded generator (6-8)."""
    own = torch.Generator().manual_seed(span_seed)
    spans = [VerifySpan(0, 2, True), VerifySpan(3, 2, False, None, draft_probs), VerifySpan(6, 2, False, own)]
    proposals = torch.tensor([5, 6, -1, 7, 8, -1, 9, 10, -1])
    return VerifyBatch(spans, proposals, torch.arange(3).repeat_interleave(3), torch.arange(3).repeat(3),
                       torch.tensor([0, 3, 6]), torch.tensor([False, True, True]))


def mixed_logits() -> torch.Tensor:
    logits = torch.zeros(9, VOCAB)  # the random spans: uniform, so a one-hot proposal is rejected
    logits[0, 5] = logits[1, 6] = logits[2, 11] = 10.0  # greedy: both proposals kept, then 11
    return logits


def mixed_meta() -> SamplingMetadata:
    return SamplingMetadata(9, random_rows=torch.arange(3, 9), temperature=torch.ones(6), unseeded=torch.arange(3),
                            seeded=[(3, torch.Generator()), (4, torch.Generator()), (5, torch.Generator())])


def verify_mixed(sampler_seed: int, span_seed: int, global_seed: int, draft_probs=None) -> list[int]:
    torch.manual_seed(global_seed)  # never read: the draws come from the sampler's and the spans' generators
    out = rejection_sample(Sampler(sampler_seed, CPU), mixed_logits(), mixed_meta(), mixed_batch(span_seed, draft_probs))
    return out.token_ids.tolist()


def test_each_span_draws_from_its_own_generator_only():
    base = verify_mixed(1, 5, 0)
    assert base[:3] == [5, 6, 11]  # greedy
    assert verify_mixed(1, 5, 123) == base  # the global RNG plays no part
    other_engine = verify_mixed(2, 5, 0)
    assert other_engine[:3] == base[:3] and other_engine[6:] == base[6:] and other_engine[3:6] != base[3:6]
    other_span = verify_mixed(1, 6, 0)
    assert other_span[:6] == base[:6] and other_span[6:] != base[6:]
    for tokens in (base, other_engine, other_span):  # uniform p, one-hot q: rejected at the first row
        assert tokens[4:6] == [-1, -1] and tokens[7:] == [-1, -1] and tokens[3] not in (7, -1) and tokens[6] not in (9, -1)


def test_a_draft_that_matches_the_target_is_always_accepted():
    """q == p: u * q(d) <= p(d) for every u in [0, 1), so both proposals and the bonus come out."""
    uniform = torch.full((2, VOCAB), 1.0 / VOCAB)
    tokens = verify_mixed(1, 5, 0, draft_probs=uniform)
    assert tokens[3:5] == [7, 8] and tokens[5] >= 0


def test_emitted_tokens_carry_their_raw_logprobs():
    logits = mixed_logits()
    out = rejection_sample(Sampler(1, CPU), logits, mixed_meta(), mixed_batch(5))
    expected = torch.log_softmax(logits, dim=-1).gather(1, out.token_ids.clamp(min=0).unsqueeze(1)).squeeze(1)
    emitted = out.token_ids >= 0
    torch.testing.assert_close(out.logprobs[emitted], expected[emitted])


def test_acceptance_draws_come_from_the_engines_generator_or_the_spans_own():
    """p(proposal) = 1/2: each of 40 spans keeps its proposal when its uniform draw is <= 1/2, so
    the accepted pattern follows the draws: the same for the same generators whatever the global
    RNG, different for another engine seed (unseeded spans) or another span seed (seeded)."""
    spans = 40
    logits = torch.zeros(2 * spans, 4)
    logits[0::2, 1] = logits[0::2, 0] = 1.0  # proposal rows: p = [1/2 - e, 1/2 - e, e, e] roughly; the proposal is 1
    logits[0::2, 2:] = -30.0

    def accepted(engine_seed: int, span_seed: int | None, global_seed: int) -> list[bool]:
        torch.manual_seed(global_seed)
        own = None if span_seed is None else torch.Generator().manual_seed(span_seed)
        batch = VerifyBatch([VerifySpan(2 * s, 1, False, own) for s in range(spans)], torch.tensor([1, -1] * spans),
                            torch.arange(spans).repeat_interleave(2), torch.tensor([0, 1] * spans), torch.arange(0, 2 * spans, 2),
                            torch.ones(spans, dtype=torch.bool))
        out = rejection_sample(Sampler(engine_seed, CPU), logits, random_meta(2 * spans), batch)
        return (out.token_ids.view(spans, 2)[:, 0] == 1).tolist()

    base = accepted(1, None, 0)
    assert 5 < sum(base) < 35 and accepted(1, None, 99) == base and accepted(2, None, 0) != base
    seeded = accepted(1, 5, 0)
    assert accepted(2, 5, 99) == seeded and accepted(1, 6, 0) != seeded


def test_greedy_and_seeded_spans_take_no_draws_from_the_engines_generator():
    """40 unseeded spans (p(proposal) = 1/2) come out the same alone and behind a greedy and a
    seeded span that propose too: only unseeded spans draw from the engine's generator, so the
    rest of the batch never shifts their draws."""
    spans = 40
    body_logits = torch.zeros(2 * spans, 4)
    body_logits[0::2, 0] = body_logits[0::2, 1] = 1.0
    body_logits[0::2, 2:] = -30.0

    def body_tokens(behind_others: bool) -> list[int]:
        head = [VerifySpan(0, 2, True), VerifySpan(3, 2, False, torch.Generator().manual_seed(7))] if behind_others else []
        first = 6 if behind_others else 0
        all_spans = head + [VerifySpan(first + 2 * s, 1, False) for s in range(spans)]
        proposals = [1, 1, -1, 1, 1, -1][:first] + [1, -1] * spans
        row_span = [i for i, span in enumerate(all_spans) for _ in range(span.num_proposals + 1)]
        row_offset = [j for span in all_spans for j in range(span.num_proposals + 1)]
        batch = VerifyBatch(all_spans, torch.tensor(proposals), torch.tensor(row_span), torch.tensor(row_offset),
                            torch.tensor([s.first_row for s in all_spans]), torch.tensor([not s.greedy for s in all_spans]))
        random_rows = torch.arange(3 if behind_others else 0, first + 2 * spans)
        meta = SamplingMetadata(first + 2 * spans, random_rows=random_rows, temperature=torch.ones(len(random_rows)))
        logits = torch.cat([torch.zeros(first, 4), body_logits])
        return rejection_sample(Sampler(1, CPU), logits, meta, batch).token_ids[first:].tolist()

    alone = body_tokens(False)
    assert 5 < alone[0::2].count(1) < 35 and body_tokens(True) == alone


def test_a_rejected_proposal_is_never_the_replacement_token():
    """One span at a time (in a large batch the bonus rows of accepted spans hide the slip): after
    d = 1 is rejected the token comes from p minus d, so it is never 1; after it is accepted the
    bonus row emits a token."""
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    logits = torch.stack([p.log(), p.log()])
    rejected = 0
    for seed in range(40):
        tokens = rejection_sample(Sampler(seed, CPU), logits, random_meta(2), one_proposal_batch(1, torch.tensor([1]), None))
        first, bonus = tokens.token_ids.tolist()
        assert (first == 1) == (bonus >= 0)
        rejected += first != 1
    assert 5 < rejected < 30


def test_plain_greedy_verification_skips_the_log_softmax_and_keeps_the_logprobs(monkeypatch):
    """Plain greedy rows (no random rows, penalties, masks or logprob ranks) take the sampler's greedy
    kernel: the emitted tokens' logprobs are still the raw log-softmax's, and no whole-vocabulary
    log-softmax is computed (the fast path's reason: ~4 ms of a 4-row SmolLM2 verification)."""
    import pagedllm.spec_decode.rejection as rejection

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    argmax = logits.argmax(dim=-1)
    proposals = torch.tensor([int(argmax[0]), int(argmax[1]), int(argmax[2]) + 1, -1])  # kept, kept, rejected
    batch = VerifyBatch([VerifySpan(0, 3, True)], proposals, torch.zeros(4, dtype=torch.long), torch.arange(4),
                        torch.tensor([0]), torch.tensor([False]))
    expected_tokens = [int(argmax[0]), int(argmax[1]), int(argmax[2]), -1]
    expected_logprobs = torch.log_softmax(logits, dim=-1).gather(1, argmax.unsqueeze(1)).squeeze(1)[:3]

    def refuse(*args, **kwargs):
        raise AssertionError("plain greedy verification computed a whole log-softmax")

    monkeypatch.setattr(rejection.torch, "log_softmax", refuse)
    out = rejection_sample(Sampler(0, CPU), logits, SamplingMetadata(4), batch)
    assert out.token_ids.tolist() == expected_tokens
    torch.testing.assert_close(out.logprobs[:3], expected_logprobs)
