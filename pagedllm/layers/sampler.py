"""Token sampling for a step's rows: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from
p. A seeded sequence draws its noise from its own generator — one fixed-size draw per sampled
token — so it gets the same tokens whatever else shares the batch. Greedy rows draw nothing.

Logprobs are those of the raw model distribution (before penalties and temperature), as vLLM
returns by default and as evaluation harnesses expect.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    rank: int | None  # 1-based rank of the chosen token, when logprobs were asked for
    top: list[tuple[int, float]] | None  # top-N (token, logprob), when logprobs were asked for


def apply_penalties(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """Repetition (prompt + output, transformers' rule), presence and frequency (output only,
    OpenAI's rule), in place."""
    vocab = logits.shape[-1]
    for row, seq in zip(rows, seqs):
        params = seq.request.params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            values = logits[row, seen]
            penalty = params.repetition_penalty
            logits[row, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if params.presence_penalty or params.frequency_penalty:
            output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(output[output < vocab], minlength=vocab).to(logits.dtype)
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def ban_stop_tokens(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """min_tokens: EOS and stop_token_ids cannot be sampled before the minimum is reached."""
    vocab = logits.shape[-1]
    for row, seq in zip(rows, seqs):
        params = seq.request.params
        if seq.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= seq.request.eos_token_ids
            banned_ids = [t for t in banned if t < vocab]
            if banned_ids:
                logits[row, banned_ids] = float("-inf")


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask tokens outside top-k, outside the top-p nucleus, or below min_p x the top prob."""
    vocab = logits.shape[-1]
    if any(k != -1 and k < vocab for k in top_k):
        k = torch.tensor([k if k != -1 else vocab for k in top_k], device=logits.device).clamp(max=vocab)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= p  # the most likely token is always kept
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """logits: [R, V] float32, one row per sequence to sample for."""
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = self._process(logits, seqs)
        tokens = self._choose(processed, seqs)
        return self._results(raw_logprobs, tokens, seqs)

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = list(range(len(seqs)))
        needs_penalty = [
            r for r in rows
            if seqs[r].request.params.repetition_penalty != 1.0
            or seqs[r].request.params.presence_penalty
            or seqs[r].request.params.frequency_penalty
            or seqs[r].num_output_tokens < seqs[r].request.params.min_tokens
        ]
        if not needs_penalty:
            return logits
        logits = logits.clone()
        chosen = [seqs[r] for r in needs_penalty]
        apply_penalties(logits, needs_penalty, chosen)
        ban_stop_tokens(logits, needs_penalty, chosen)
        return logits

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [r for r, s in enumerate(seqs) if not s.request.params.greedy]
        if not random_rows:
            return tokens
        params = [seqs[r].request.params for r in random_rows]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        scaled = logits[random_rows] / temps.unsqueeze(1)
        scaled = filter_logits(scaled, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
        probs = scaled.softmax(dim=-1)
        noise = self._exponential_noise(probs, [seqs[r] for r in random_rows])
        tokens[random_rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def _exponential_noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i].exponential_(generator=seq.generator)
        return noise

    @staticmethod
    def _results(raw_logprobs: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        token_list, chosen_list = tokens.tolist(), chosen.tolist()
        results = []
        for row, seq in enumerate(seqs):
            num = seq.request.params.logprobs
            if num is None:
                results.append(SampleResult(token_list[row], chosen_list[row], None, None))
                continue
            results.append(SampleResult(token_list[row], chosen_list[row], *top_logprobs(raw_logprobs[row], token_list[row], num)))
        return results


def top_logprobs(logprobs: torch.Tensor, token: int, num: int) -> tuple[int, list[tuple[int, float]]]:
    """Rank of `token` (1 = most likely) and the `num` most likely (token, logprob) pairs."""
    rank = int((logprobs > logprobs[token]).sum().item()) + 1
    if num == 0:
        return rank, []
    values, ids = logprobs.topk(num)
    return rank, list(zip(ids.tolist(), values.tolist()))
