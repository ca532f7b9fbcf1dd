"""What the model runner keeps of each sequence between steps (vLLM v1's CachedRequestState).

A step sends a sequence whole once and afterwards only what changed (step/scheduler_output.py);
this is where the changes are applied, on rank 0 and on every tensor-parallel rank alike. From
the state and a step's chunk the runner lays out the chunk's rows (`BatchChunk`) and its sample
row (`SampleRow`): the token history penalties read and the sampling parameters live here, not
in the step.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import SamplingParams
from pagedllm.step.scheduler_output import NewSequence, ScheduledChunk, SchedulerOutput, SequenceUpdate
from pagedllm.worker.input_batch import BatchChunk
from pagedllm.worker.sampling_inputs import SampleRow


@dataclass(slots=True)
class SequenceState:
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    sample_index: int
    eos_token_ids: frozenset[int]
    block_table: list[int]
    num_computed_tokens: int

    @classmethod
    def new(cls, seq: NewSequence) -> "SequenceState":
        return cls(seq.token_ids, seq.num_prompt_tokens, seq.params, seq.sample_index, seq.eos_token_ids, seq.block_table,
                   seq.num_computed_tokens)

    def update(self, update: SequenceUpdate) -> None:
        self.token_ids += update.new_token_ids
        self.num_computed_tokens = update.num_computed_tokens
        if update.block_table is not None:
            self.block_table = update.block_table
        for index, block in update.replaced_blocks:
            self.block_table[index] = block
        if update.new_block_ids:
            self.block_table += update.new_block_ids


class SequenceStates(dict[int, SequenceState]):
    """seq id -> its state, for every sequence the runner holds."""

    def apply(self, sched: SchedulerOutput) -> None:
        """A step's changes, in the order they happened: finished and preempted sequences go,
        new ones come (a recomputed one comes back whole), the others change."""
        for seq_id in sched.finished_seq_ids + sched.preempted_seq_ids:
            self.pop(seq_id, None)
        for seq in sched.new_seqs:
            self[seq.seq_id] = SequenceState.new(seq)
        for update in sched.updates:
            self[update.seq_id].update(update)

    def batch_chunk(self, chunk: ScheduledChunk, proposals: list[int]) -> BatchChunk:
        """A scheduled chunk's rows: its known tokens from the first without KV, then the
        proposals it verifies (the rest of its tokens)."""
        state = self[chunk.seq_id]
        start, num_tokens = state.num_computed_tokens, chunk.num_tokens
        num_known = min(num_tokens, len(state.token_ids) - start)
        tokens = state.token_ids[start : start + num_known]
        if num_tokens > num_known:
            tokens += proposals[: num_tokens - num_known]
        return BatchChunk(chunk.seq_id, start, tokens, state.block_table, chunk.prompt_logprobs, num_tokens - num_known)

    def sample_row(self, seq_id: int, chunk: int, spec_token_ids: list[int], allowed_tokens=None) -> SampleRow:
        state = self[seq_id]
        return SampleRow(seq_id, chunk, state.params, state.sample_index, state.token_ids, state.num_prompt_tokens,
                         state.eos_token_ids, spec_token_ids, allowed_tokens)
