"""Verifying proposed tokens by rejection sampling, so the output follows the target model exactly.

A sequence that proposed k tokens d_1..d_k is scored at k + 1 rows: row j holds the target's
distribution p_j for the position of d_{j+1} (row k: the position after d_k). Proposal d_{j+1},
drawn from the proposer's q_j, is accepted with probability min(1, p_j(d) / q_j(d)); at the first
rejection the sequence takes a token from norm(max(0, p_j - q_j)) and stops; if all k are
accepted it takes a bonus token from p_k. This keeps each token distributed exactly as p
(Leviathan et al. / Chen et al., 2023). An n-gram proposal is deterministic (q = one-hot), so
d is kept with probability p(d). Greedy rows keep d while it is the target's argmax and then
take the argmax: exactly the tokens greedy decoding without speculation would produce.

Seeded sequences draw their k uniforms and their final token's noise from their own generator,
in that order, so their tokens do not depend on the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, exponential_, plain_greedy


@dataclass
class VerifySpan:
    """One sequence's rows: first row, number of proposals k, and how its randomness is drawn."""

    first_row: int
    num_proposals: int
    greedy: bool
    generator: torch.Generator | None = None  # a seeded sequence's own
    draft_probs: torch.Tensor | None = None  # [>= k, V] the draft model's q rows; None: one-hot


@dataclass
class VerifyBatch:
    spans: list[VerifySpan]
    proposals: torch.Tensor  # [X] the proposal each row verifies; -1 on every span's last row
    row_span: torch.Tensor  # [X] index of each row's span
    row_offset: torch.Tensor  # [X] row position j within its span
    span_first_row: torch.Tensor  # [S]
    span_random: torch.Tensor  # [S] bool
    extra: dict = field(default_factory=dict)


def rejection_sample(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, batch: VerifyBatch) -> SamplerOutput:
    """Tokens emitted per row: accepted proposals, then the final token at the first rejected
    (or the bonus) row, -1 after it."""
    plain = plain_greedy(meta)
    if plain:  # every emitted token is its row's argmax: the sampler's greedy kernel gives both, no log-softmax
        greedy = sampler.greedy(logits)
        greedy_tokens = greedy.token_ids
    else:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = sampler.process(logits, meta)
        greedy_tokens = processed.argmax(dim=-1)
    proposed = batch.proposals >= 0
    safe_proposals = batch.proposals.clamp(min=0)
    accept = greedy_tokens == batch.proposals
    p = q = None
    if meta.random_rows is not None:
        p = torch.zeros_like(logits).index_copy_(0, meta.random_rows, sampler.probs(processed, meta))
        q = _proposal_probs(batch, safe_proposals, proposed, logits)
        uniforms = _draw_uniforms(sampler, batch, logits.device)
        p_d, q_d = p.gather(1, safe_proposals.unsqueeze(1)).squeeze(1), q.gather(1, safe_proposals.unsqueeze(1)).squeeze(1)
        random_row = batch.span_random.index_select(0, batch.row_span)
        accept = torch.where(random_row, uniforms * q_d <= p_d, accept)
    accept &= proposed
    stops = torch.where(accept, torch.full_like(batch.row_offset, 1 << 30), batch.row_offset)
    first_stop = torch.full_like(batch.span_first_row, 1 << 30).scatter_reduce(0, batch.row_span, stops, "amin")
    final_rows = batch.span_first_row + first_stop
    final = greedy_tokens.index_select(0, final_rows)
    if p is not None:
        final = torch.where(batch.span_random, _sample_residual(sampler, p, q, final_rows, batch), final)
    emitted = torch.where(batch.row_offset < first_stop.index_select(0, batch.row_span), batch.proposals, -1)
    emitted = emitted.index_copy(0, final_rows, final)
    if plain:  # an accepted proposal equals its row's argmax, and so does the final token
        return SamplerOutput(emitted, greedy.logprobs)
    return sampler.with_logprobs(raw_logprobs, emitted, meta)


def _proposal_probs(batch: VerifyBatch, proposals: torch.Tensor, proposed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """q per row: the draft model's distribution, or one-hot on the proposal; 0 on last rows."""
    q = torch.zeros_like(logits)
    q.scatter_(1, proposals.unsqueeze(1), proposed.to(logits.dtype).unsqueeze(1))
    for span in batch.spans:
        if span.draft_probs is not None and span.num_proposals:
            rows = slice(span.first_row, span.first_row + span.num_proposals)
            q[rows] = span.draft_probs[: span.num_proposals].to(logits.dtype)
    return q


def _draw_uniforms(sampler: Sampler, batch: VerifyBatch, device: torch.device) -> torch.Tensor:
    """U(0,1) per proposal of random spans; seeded spans from their own generator."""
    uniforms = torch.ones(batch.proposals.shape[0], device=device)
    unseeded = [s for s in batch.spans if not s.greedy and s.generator is None and s.num_proposals]
    if unseeded:
        draws = torch.rand(sum(s.num_proposals for s in unseeded), generator=sampler.generator, device=device)
        offset = 0
        for span in unseeded:
            uniforms[span.first_row : span.first_row + span.num_proposals] = draws[offset : offset + span.num_proposals]
            offset += span.num_proposals
    for span in batch.spans:
        if not span.greedy and span.generator is not None and span.num_proposals:
            uniforms[span.first_row : span.first_row + span.num_proposals] = torch.rand(
                span.num_proposals, generator=span.generator, device=device)
    return uniforms


def _sample_residual(sampler: Sampler, p: torch.Tensor, q: torch.Tensor, final_rows: torch.Tensor, batch: VerifyBatch) -> torch.Tensor:
    """A token from norm(max(0, p - q)) at each span's final row (q is 0 on a bonus row)."""
    p_final = p.index_select(0, final_rows)
    residual = (p_final - q.index_select(0, final_rows)).clamp(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q there: rejection had probability 0
    residual = torch.where(empty, p_final, residual)
    noise = torch.ones_like(residual)
    unseeded = [i for i, s in enumerate(batch.spans) if not s.greedy and s.generator is None]
    if unseeded:
        draw = torch.empty((len(unseeded), residual.shape[1]), dtype=residual.dtype, device=residual.device)
        exponential_(draw, sampler.generator)
        for position, span_index in enumerate(unseeded):
            noise[span_index] = draw[position]
    for span_index, span in enumerate(batch.spans):
        if not span.greedy and span.generator is not None:
            exponential_(noise[span_index], span.generator)
    return (residual / noise).argmax(dim=-1)
