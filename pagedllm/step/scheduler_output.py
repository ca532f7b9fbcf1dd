"""What one scheduler step hands the model runner: only what changed since the last step.

The runner keeps each sequence's state between steps (vLLM v1's NewRequestData and
CachedRequestData): a sequence is sent whole once (`NewSequence`: its tokens, sampling
parameters and block table); afterwards a step carries, for the sequences it computes, only
their new token ids and new block ids (a tail block replaced by copy-on-write; the whole table
after a swap-in), and which sequences finished or lost their KV. So a step's bytes do not grow
with the sequences' lengths, however long they run, and under tensor parallelism every rank
applies the same changes to its own copy (tests/step/test_step_bytes.py).

What a scheduled sequence computes is a chunk of positions and a token budget: how many tokens
the step may give it. How the runner fills that budget (one forward pass, several greedy steps in
one call, speculation cycles) is the planner's to say (step/planner.py), not a flag here. No
`Sequence` objects: this module is a leaf that both sides import.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams

BlockPairs = list[tuple[int, int]]

# A token sampled by a step whose output has not reached the host yet (async scheduling: the
# next step is scheduled while the device still runs this one). A sequence's new token ids may
# end with it; the runner takes such an input from the previous step's samples on the device.
PENDING_TOKEN = -1


@dataclass
class PromptLogprobsRequest:
    """Logprobs of prompt tokens `targets` at positions start+1 ... start+len(targets), each given
    the tokens before it (computed from the rows at positions start ... start+len(targets)-1)."""

    num: int  # top-N alternatives per position
    start: int
    targets: list[int]


@dataclass(slots=True)
class NewSequence:
    """A sequence the runner does not hold: everything it keeps of it. Sent when a sequence is
    first scheduled, when a sample is forked, and again after a preemption dropped its KV."""

    seq_id: int
    token_ids: list[int]  # prompt + output so far (a copy)
    num_prompt_tokens: int
    params: SamplingParams
    sample_index: int  # which sample of its request: seeds a seeded request's per-sample generator
    eos_token_ids: frozenset[int]
    block_table: list[int]  # a copy
    num_computed_tokens: int  # positions whose KV is valid already (a prefix-cache hit, a fork's parent's)
    # A sample forked this step (n / best_of) samples from the last row of this sequence's chunk.
    forked_from: int | None = None
    lora: Any = None  # its request's LoRARequest (lora/request.py), None for the base model


@dataclass(slots=True)
class SequenceUpdate:
    """What changed of a sequence the runner holds, since the step that last scheduled it."""

    seq_id: int
    num_computed_tokens: int
    new_token_ids: list[int] | tuple[()] = ()  # appended to its tokens
    new_block_ids: list[int] | tuple[()] = ()  # appended to its table
    replaced_blocks: list[tuple[int, int]] | tuple[()] = ()  # (index, block): copy-on-write
    block_table: list[int] | None = None  # the whole table, when more than its tail changed (a swap-in)


@dataclass(slots=True)
class ScheduledChunk:
    """Positions [num_computed_tokens, num_computed_tokens + num_tokens) of one sequence, computed
    this step; a decode's proposals to verify are among them (the runner made them)."""

    seq_id: int
    num_tokens: int
    # The most tokens the step may give the sequence: 0 for a chunk that ends mid-prompt, 1 for
    # one next token, more for a burst (the block table then covers that many positions from the
    # chunk's start).
    token_budget: int = 1
    max_proposals: int = 0  # speculative tokens it may propose for the next step to verify
    prompt_logprobs: PromptLogprobsRequest | None = None


@dataclass
class SchedulerOutput:
    new_seqs: list[NewSequence] = field(default_factory=list)
    updates: list[SequenceUpdate] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    allowed_tokens: dict[int, Any] = field(default_factory=dict)  # seq id -> grammar bitmask (int32) of its next token
    blocks_to_swap_out: BlockPairs = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)  # (host, device)
    blocks_to_copy: BlockPairs = field(default_factory=list)  # (source, destination), copy-on-write
    # Preempted by recompute since the previous step: their KV is gone, and they come back as
    # new sequences. (A swapped-out sequence keeps its state; its table changes at swap-in.)
    preempted_seq_ids: list[int] = field(default_factory=list)
    # Sequences that finished since the previous step: the runner drops its state for them.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Secure mode (secure_kv_blocks): freed blocks whose K/V the runner zeroes, in every pool that
    # mirrors the device pool, after the swap-outs have read them and before anything is written
    # to them (swap-ins, copies, this step's tokens); and freed host swap blocks, after the swap-ins.
    blocks_to_zero: list[int] = field(default_factory=list)
    host_blocks_to_zero: list[int] = field(default_factory=list)
    # A greedy burst (every chunk a plain greedy decode): the fused call takes each row's argmax,
    # token_budget steps of it (one, unless multi-step scheduling made the burst longer)
    greedy_burst: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
