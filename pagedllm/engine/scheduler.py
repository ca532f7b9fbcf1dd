"""Continuous-batching scheduler: one token budget per step (seed 001 algorithms 3, 6 and 8).

Each step serves, in order: running sequences (decodes and unfinished prefill chunks), then
swapped-out sequences coming back, then waiting sequences by priority then arrival. A step can
therefore mix prefill chunks with decodes. When the pool cannot hold a running sequence's next
tokens, the scheduler preempts the running sequence its policy values least:

- fcfs: the latest arrival (older requests keep their progress);
- priority: the lowest priority (higher number = more important, as seed 000 says), then latest;
- shortest_remaining: the one closest to its max_tokens, as seed 001 specifies.

Running sequences are visited from most to least worth keeping and victims are taken from the
other end, so a victim has never been scheduled earlier in the same step.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pagedllm.engine.block_manager import BlockManager, BlockPairs
from pagedllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_context(self) -> bool:
        """After this chunk every known token has KV, so the next token can be sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)
    blocks_to_copy: BlockPairs = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    ended: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str
    preemption_policy: str


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0

    # ---- queues ------------------------------------------------------------------------------
    @staticmethod
    def _arrival_key(seq: Sequence) -> tuple:
        return (-seq.request.priority, seq.request.arrival_time, seq.request.request_id, seq.index)

    def _keep_key(self, seq: Sequence) -> tuple:
        """Sort key: sequences worth keeping most come first; victims come from the end."""
        policy = self.config.preemption_policy
        if policy == "shortest_remaining":
            remaining = (seq.request.params.max_tokens or self.config.max_model_len) - seq.num_output_tokens
            return (-remaining, *self._arrival_key(seq))
        if policy == "priority":
            return self._arrival_key(seq)
        return self._arrival_key(seq)[1:]  # fcfs: arrival order only

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self._arrival_key)

    def add_running(self, seq: Sequence) -> None:
        """A freshly forked sample: it already shares its parent's computed blocks."""
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq.seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out

    def _chunk(self, seq: Sequence, num_new: int, budget: int) -> int:
        if num_new <= budget:
            return num_new
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = deque(sorted(self.running, key=self._keep_key))
        kept: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            if self._exceeds_pool(seq):
                self._end_for_capacity(seq, out)
                continue
            num_new = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                kept.append(seq)  # no budget left this step; it keeps its blocks
                continue
            copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            while copies is None:
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is None:
                continue
            out.blocks_to_copy.extend(copies)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            kept.append(seq)
            budget -= num_new
        self.running = kept
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        self.swapped.sort(key=self._keep_key)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if self._exceeds_pool(seq):
                self.swapped.pop(0)
                self._end_for_capacity(seq, out)
                continue
            extra = self.block_manager.blocks_for(seq.num_tokens) - len(self.block_manager.cpu_tables[seq.seq_id])
            if not self.block_manager.can_swap_in(seq.seq_id, max(extra, 0)):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(seq.seq_id))
            seq.set_status(SequenceStatus.RUNNING)
            num_new = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            self.running.append(seq)
            if num_new:
                copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
                assert copies == [], "swapped-in blocks are private and space was checked"
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._exceeds_pool(seq):
                self.waiting.pop(0)
                self._end_for_capacity(seq, out)
                continue
            samples = 1 if seq.request.forked else seq.request.params.best_of
            if self.running and len(self.running) + samples > self.config.max_num_seqs:
                break
            use_cache = seq.request.params.prompt_logprobs is None
            cached = bm.allocate_prefix(seq.seq_id, seq.token_ids, use_cache=use_cache)
            num_new = self._chunk(seq, seq.num_tokens - cached, budget)
            copies = bm.allocate_slots(seq.seq_id, cached, num_new) if num_new else None
            if copies is None:
                bm.free(seq.seq_id)
                break
            if use_cache:
                bm.record_prefix_query(seq.num_tokens, cached)
            self.waiting.pop(0)
            seq.num_computed_tokens = cached
            if not seq.request.forked:
                seq.request.num_cached_tokens = cached
            seq.set_status(SequenceStatus.RUNNING)
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

    # ---- preemption --------------------------------------------------------------------------
    def _exceeds_pool(self, seq: Sequence) -> bool:
        return self.block_manager.blocks_for(seq.num_tokens) > self.block_manager.num_blocks

    def _end_for_capacity(self, seq: Sequence, out: SchedulerOutput) -> None:
        """A sequence longer than the whole pool can never run: end it rather than loop."""
        self.block_manager.free(seq.seq_id)
        if seq.status is SequenceStatus.SWAPPED:
            seq.set_status(SequenceStatus.RUNNING)  # the state diagram ends sequences from RUNNING
        seq.set_status(SequenceStatus.FINISHED_LENGTH)
        out.ended.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap":
            pairs = self.block_manager.swap_out(seq.seq_id)
            if pairs is not None:
                self.num_swap_outs += 1
                out.blocks_to_swap_out.extend(pairs)
                seq.set_status(SequenceStatus.SWAPPED)
                self.swapped.append(seq)
                return
        # recompute (or swap space exhausted): drop the KV, keep the tokens, start over later.
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.set_status(SequenceStatus.WAITING)
        self.add(seq)
