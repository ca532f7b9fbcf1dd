"""What the model runner hands back to the scheduler after a step: host-side values only.

A leaf module (the scheduler imports it; it imports nothing of the engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampledToken:
    """A token with its logprob under the raw model distribution.

    For a sampled token `rank` and `top` are filled only when the request asked for logprobs;
    for a prompt token (prompt logprobs) always."""

    token_id: int
    logprob: float
    rank: int | None = None  # 1 = most likely
    top: list[tuple[int, float]] | None = None  # the top-N (token, logprob)


@dataclass
class ModelRunnerOutput:
    # seq id -> the tokens sampled for it this step, in order
    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    # seq id -> one entry per prompt position scored this step (the prompt token at the next position)
    prompt_logprobs: dict[int, list[SampledToken]] = field(default_factory=dict)
    # speculative decoding: seq id -> tokens proposed for the next step to verify
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq id -> positions whose draft-model KV is now valid (draft-model speculation only)
    draft_computed: dict[int, int] = field(default_factory=dict)
    # fused speculation cycles: seq id -> (proposals verified, accepted) of each cycle that proposed
    spec_cycles: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
