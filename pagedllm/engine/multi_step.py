"""Multi-step scheduling: several greedy decode steps in one engine step.

Why: a small decode step on a CPU costs the time to stream the weights, and after that stream
the engine's per-step Python (schedule, stage, sample, advance, detokenize) runs on flushed
caches, at a cost of the order of a tenth of a single-stream step. When every sequence of a step
is a plain greedy decode, the next input of each is its argmax, so the runner can run n steps in
one call and the engine's Python runs once per n tokens, as vLLM's `num_scheduler_steps` did.
Outputs then arrive n tokens at a time, and a request that arrives meanwhile waits up to n steps,
so a step is multi-step only while no sequence waits to be admitted or swapped in.

The tokens are those of single steps: each step is the same fused step with the same greedy
rule. Stop rules are applied afterwards, token by token; the tokens a sequence generated past
its stop are dropped with its blocks.
"""
from __future__ import annotations

from pagedllm.engine.sequence import Sequence


def can_multi_step(seq: Sequence) -> bool:
    """A plain greedy decode with no proposals to verify."""
    return is_plain_greedy_decode(seq) and not seq.spec_token_ids


def is_plain_greedy_decode(seq: Sequence) -> bool:
    """A greedy decode whose tokens are argmaxes and nothing more: its next input is its argmax,
    whatever the other rows do (multi-step scheduling, fused speculation cycles)."""
    params = seq.request.params
    return (
        seq.num_tokens - seq.num_computed_tokens == 1
        and params.greedy
        and params.logprobs in (None, 0)  # the chosen token's own logprob (rank 1) is all a step gives
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and seq.num_output_tokens >= params.min_tokens
        and seq.grammar is None
    )


def tokens_left(seq: Sequence, max_model_len: int) -> int:
    """The most tokens the sequence may still generate (max_tokens, then the model's length)."""
    left = max_model_len - seq.num_tokens
    max_tokens = seq.request.params.max_tokens
    return left if max_tokens is None else min(left, max_tokens - seq.num_output_tokens)


def num_steps(seqs: list[Sequence], most: int, max_model_len: int) -> int:
    """How many steps these sequences can take together: 1 unless all of them can multi-step."""
    if most <= 1 or not seqs or not all(can_multi_step(seq) for seq in seqs):
        return 1
    return max(1, min(most, *(tokens_left(seq, max_model_len) for seq in seqs)))
