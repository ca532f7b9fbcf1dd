"""What one scheduler step hands the model runner: plain data, no `Sequence` objects.

The runner needs, per sequence, only the tokens to compute, where they sit (positions and block
table) and how to sample; keeping it to that makes the runner independent of request state
(which the scheduler alone changes) and keeps this module a leaf that both sides import.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams

BlockPairs = list[tuple[int, int]]


@dataclass
class PromptLogprobsRequest:
    """Logprobs of prompt tokens `targets` at positions start+1 ... start+len(targets), each given
    the tokens before it (computed from the rows at positions start ... start+len(targets)-1)."""

    num: int  # top-N alternatives per position
    start: int
    targets: list[int]


@dataclass
class ScheduledChunk:
    """Positions [start, start + len(token_ids)) of one sequence, computed this step."""

    seq_id: int
    start: int
    token_ids: list[int]
    block_table: list[int]  # the sequence's blocks; covers every position up to the chunk's end
    prompt_logprobs: PromptLogprobsRequest | None = None
    # Rows past the first laid out as decode rows, each attending to the context up to its own
    # position: a decode's proposals to verify (token_ids = [last token, *proposals]), or, where
    # the model runner or a draft runs a short chunk as one fused step, the chunk's other tokens.
    num_spec: int = 0
    draft_start: int = 0  # first position whose draft-model KV is not yet valid

    @property
    def is_decode(self) -> bool:
        """One new position per row of context (a plain decode, or a decode with proposals)."""
        return self.num_tokens == 1 + self.num_spec

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class SampleRow:
    """One token to sample for `seq_id`, from the logits of chunk `chunk`'s last position (its own
    chunk, or the chunk of the parent it was forked from this step)."""

    seq_id: int
    chunk: int
    params: SamplingParams
    sample_index: int  # which sample of its request: seeds a seeded request's per-sample generator
    token_ids: list[int]  # prompt + output so far (penalties look at it; read, never kept)
    num_prompt_tokens: int
    eos_token_ids: frozenset[int]
    spec_token_ids: list[int] = field(default_factory=list)  # proposals verified at this row's chunk
    allowed_tokens: Any = None  # structured output: int32 bitmask of the tokens the grammar allows

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)  # (host, device)
    blocks_to_copy: BlockPairs = field(default_factory=list)  # (source, destination), copy-on-write
    preempted_seq_ids: list[int] = field(default_factory=list)
    # Sequences that finished since the previous step: the runner drops its state for them.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Greedy steps to run, each row's argmax fed back as its next input (multi-step scheduling);
    # every block table then covers its row's position + num_steps - 1.
    num_steps: int = 1
    # Whether decodes propose speculative tokens for the next step (off while the batch is large;
    # a draft model then skips decodes and catches up on them when proposals resume).
    propose: bool = True
    # Greedy draft-model speculation cycles (propose, verify, accept) the runner runs for every
    # chunk of this step in one call (0: none); every chunk is then a plain greedy decode whose
    # block table covers fused_spec_cycles * (k + 1) positions from its chunk's start.
    fused_spec_cycles: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
