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
