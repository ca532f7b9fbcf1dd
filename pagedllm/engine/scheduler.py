"""Continuous-batching scheduler: one token budget per step (scheduling, chunked prefill and preemption).

Each step spends its token budget in this order (design 001, Algorithm 6):

1. running decodes, each its one token (and the proposals it verifies, as far as the budget
   leaves one token for every decode after it), so that a long prompt never stalls the
   sequences already generating;
2. running prefill chunks (unfinished prompts, recomputes), by priority then arrival, each
   at most `long_prefill_token_threshold` tokens (vLLM's per-sequence cap; 0: no cap), so one
   long prompt cannot take the whole budget from the prompts behind it;
3. swapped-out sequences coming back, then waiting sequences by priority then arrival.

A step can therefore mix prefill chunks with decodes. Preemption (design 000 Algorithm 2 phase
4, 001 Algorithm 8) takes the running sequence the policy values least:

- priority (the default): the lowest priority (higher number = more important, as the
  platform's data model defines it), then the latest arrival;
- fcfs: the latest admitted (first scheduled), older admissions keep their progress;
- longest: the one holding the most tokens' KV, which frees the most blocks;
- shortest_remaining: the one closest to its max_tokens, as the engine design specifies;
- recompute_cost: the one whose recompute is cheapest per block its preemption frees (tokens
  to recompute = computed tokens not kept in the prefix cache; `_recompute_cost`).

It preempts when a running sequence's next tokens do not fit the pool, and, before that can
happen, when a step starts with fewer free blocks than the watermark (`watermark_blocks`);
admissions and swap-ins must leave the watermark free while anything runs, so a sequence is
not admitted only to be preempted at the next step. Running sequences are ranked from most to
least worth keeping and a victim is always the least worth keeping of those not scheduled yet
this step (at worst the sequence asking, which then preempts itself), so a victim has never been
scheduled earlier in the same step.

The scheduler is the single owner of the step: it alone changes the block manager, sequence
status, `num_computed_tokens` and token ids. `schedule()` hands the runner plain metadata
(`SchedulerOutput`): each scheduled sequence's chunk and token budget, and only what changed
of each since the runner last saw it (engine/runner_mirror.py); how far a sequence may advance
(proposals verified, lookahead slots, bursts of several tokens) is the planner's answer
(step/planner.py). It also passes on the blocks the block manager wants zeroed (secure mode)
and stamps the blocks each scheduled sequence reads (LRU eviction of the prefix cache).
`update_from_output()` takes the runner's tokens back, advances progress,
publishes full blocks to the prefix cache, and finishes sequences when the output processor's
stop rules say so. Extra samples of a request (n / best_of) are forked here, when the first
sample's prompt completes: they share its blocks and sample from the same logits row.

Async scheduling (`async_scheduling`, vLLM's name; the planner says where it runs): the engine
may schedule the next step while the device still runs this one. `defer_last()` then advances
the sequences of the step just sent as if its output were back — their progress, and one
placeholder (`PENDING_TOKEN`) per token each will be given, which the runner fills on the device
from the step's samples — and `update_from_output()` later swaps the placeholders for the real
tokens and applies the stop rules. Only steps whose every sequence needs nothing of its latest
tokens on the host qualify (no grammar, proposals, prompt logprobs or forks; the runner puts the
newest token among a penalised row's tokens on the device), and the
next step is scheduled ahead only when it cannot preempt (`can_schedule_ahead`): the engine
otherwise takes the output back first. A sequence that stops at a step already had
the next one scheduled: that token is computed and dropped, and the blocks it wrote are freed
before any later step, in the device's order, can reuse them.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.runner_mirror import RunnerMirror
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.spec_decode.stats import SpecDecodeStats
from pagedllm.step.planner import StepPlanner, tokens_left
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.step.scheduler_output import (PENDING_TOKEN, PromptLogprobsRequest, ScheduledChunk, SchedulerOutput,
                                             SequenceUpdate)
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm.scheduler")

# Called for each new token after it is appended; returns the status that finishes the
# sequence, if any (the output processor's stop rules).
TokenCallback = Callable[[Sequence, SampledToken], "SequenceStatus | None"]


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # including the speculative tokens to verify
    num_spec: int = 0  # its proposals verified in this chunk
    token_budget: int = 0  # tokens the step gives it (its chunk's budget)

    @property
    def completes_context(self) -> bool:
        """After this chunk every known token has KV, so the next token can be sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_spec == self.seq.num_tokens


@dataclass
class _Step:
    """The scheduler's own record of the step it is building."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    preempted: list[Sequence] = field(default_factory=list)
    num_blocks: int = 0  # block-table entries of the scheduled sequences (shared blocks counted twice)
    fusing: bool = False  # its decodes are meant for fused speculation cycles


@dataclass
class _Record:
    """A step sent to the runner whose output has not been taken back yet."""

    scheduled: list[ScheduledSequence]
    forked: bool  # it forked samples (they sample from their parent's row)
    deferred: bool = False  # its sequences were advanced ahead of its output (`defer_last`)
    out: SchedulerOutput | None = None  # what the runner was sent (for `abandon_steps`)
    swapped_out: list[Sequence] = field(default_factory=list)  # preempted to host memory by this step


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str
    preemption_policy: str
    # The most KV blocks one step may use (layer-wise KV offload's device buffer); None: the pool.
    max_step_blocks: int | None = None
    watermark: float = 0.0  # share of the pool kept free (module docstring)
    long_prefill_token_threshold: int = 0  # the most tokens of one prefill chunk; 0: no cap
    max_loras: int = 0  # the most distinct LoRA adapters among the running sequences (0: LoRA off)


class Scheduler:
    """`planner` says how far each sequence may advance (proposals verified, lookahead slots,
    bursts); the default plans plain single steps."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, structured: StructuredOutputManager | None = None,
                 planner: StepPlanner | None = None):
        self.config = config
        self.block_manager = block_manager
        self.structured = structured  # computes the masks of grammar-constrained rows
        self.planner = planner or StepPlanner(max_model_len=config.max_model_len)
        self._draft_kv = self.planner.draft_model  # a block is complete once the draft's KV is in it too
        self.mirror = RunnerMirror()  # what the runner holds of each sequence
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.live: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self._finished_ids: list[int] = []  # finished since the last schedule(), for the runner
        self._ended: list[Sequence] = []  # ended by the scheduler itself during schedule()
        self._records: deque[_Record] = deque()  # steps sent to the runner, oldest first
        self._resend_preempted: list[int] = []  # recompute preemptions of an abandoned step, for the runner
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_prompt_tokens_total = 0
        self.num_deferred_steps = 0  # steps whose sequences advanced before their output was back
        self.spec_stats = SpecDecodeStats()
        self._admissions = 0  # admission counter: fcfs preempts the latest admitted
        # vLLM's rounding: int(watermark * blocks), so small pools keep no watermark.
        self.watermark_blocks = int(config.watermark * block_manager.num_blocks)

    # ---- queues ------------------------------------------------------------------------------
    @staticmethod
    def _arrival_key(seq: Sequence) -> tuple:
        return (-seq.request.priority, seq.request.arrival_time, seq.request.request_id, seq.index)

    def _keep_key(self, seq: Sequence) -> tuple:
        """Sort key: sequences worth keeping most come first; victims come from the end. Every
        policy breaks its ties as `priority` does."""
        policy, arrival = self.config.preemption_policy, self._arrival_key(seq)
        if policy == "fcfs":
            return (seq.request.admission_index, *arrival)
        if policy == "longest":
            return (seq.num_computed_tokens, *arrival)
        if policy == "shortest_remaining":
            remaining = (seq.request.params.max_tokens or self.config.max_model_len) - seq.num_output_tokens
            return (-remaining, *arrival)
        if policy == "recompute_cost":
            return (-self._recompute_cost(seq), *arrival)
        return arrival  # priority

    def _recompute_cost(self, seq: Sequence) -> float:
        """Tokens a recompute preemption would make the sequence compute again, per block it
        frees (design 001 Algorithm 8 prefers the victim with the most recomputable prefix: a
        prefix-cache hit makes its restart cheap). Its full blocks published in the prefix cache
        stay cached when freed, so only the computed tokens past them are lost; blocks shared
        with other sequences are not freed. Nothing freed: infinitely costly, kept."""
        bm = self.block_manager
        table = bm.tables.get(seq.seq_id, [])
        freed = sum(1 for block in table if bm.ref_counts[block] == 1)
        if not freed:
            return float("inf")
        cached = 0
        while cached < len(table) and bm.content[table[cached]] is not None:
            cached += 1
        return max(seq.num_computed_tokens - cached * bm.block_size, 0) / freed

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; a request with more samples than max_num_seqs could never run (the
        engine refuses it first, naming the field)."""
        if seq.request.num_samples > self.config.max_num_seqs:
            raise ValueError(f"best_of={seq.request.num_samples} exceeds max_num_seqs={self.config.max_num_seqs}")
        self.live[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=self._arrival_key)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence wherever it is (stop rule, abort): its blocks are freed now."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.drop_pending()
        if seq.status is SequenceStatus.SWAPPED and status is not SequenceStatus.FINISHED_ABORTED:
            seq.set_status(SequenceStatus.RUNNING)  # the state diagram ends sequences from RUNNING
        seq.set_status(status)
        self.live.pop(seq.seq_id, None)
        self.mirror.forget(seq.seq_id)
        self._finished_ids.append(seq.seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.block_manager.tick()
        step = _Step()
        try:
            self._preempt_under_watermark(step)
            step.fusing = self.planner.fuses_speculation(self.running, bool(self.waiting or self.swapped))
            budget = self._schedule_running(step, self.config.max_num_batched_tokens)
            if not step.preempted:
                budget = self._schedule_swapped(step, budget)
                if not self.swapped:  # swapped-out sequences come back before waiting ones are admitted
                    self._schedule_waiting(step, budget)
            return self._finalize(step)
        except Exception:
            if not self._records or self._records[-1].out is not step.out:  # what it touched, for abandon_steps
                self._records.append(self._record(step, forked=True))
            raise

    def _finalize(self, step: _Step) -> SchedulerOutput:
        """Turn the scheduled sequences into the runner's step: their chunks and token budgets,
        forks of extra samples, and what changed of each since the runner last saw it."""
        out = step.out
        now = time.time()
        sampled: list[Sequence] = []  # the scheduled sequences whose chunk ends with a token to sample
        forks: list[tuple[Sequence, int]] = []  # (sample forked this step, the sequence it samples with)
        for item in step.scheduled:
            seq, samples = item.seq, item.completes_context
            out.chunks.append(ScheduledChunk(seq.seq_id, item.num_new_tokens, int(samples),
                                             prompt_logprobs=_prompt_logprobs_request(item)))
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
                self.num_prompt_tokens_total += len(seq.request.prompt_token_ids)
            if samples:
                sampled.append(seq)
                forks += [(child, seq.seq_id) for child in self._fork_samples(item)]
        max_proposals = self.planner.max_proposals(len(self.running))
        for chunk in out.chunks:
            chunk.max_proposals = max_proposals
        if not forks and len(sampled) == len(step.scheduled):
            self._plan_burst(step)
        for item, chunk in zip(step.scheduled, out.chunks):
            item.token_budget = chunk.token_budget
        self._describe(step, forks)  # after the burst's reservation: the tables as the runner will use them
        for seq in [item.seq for item in step.scheduled] + [child for child, _ in forks]:
            self.block_manager.touch(seq.seq_id)
        out.blocks_to_zero, out.host_blocks_to_zero = self.block_manager.take_blocks_to_zero()
        out.finished_seq_ids, self._finished_ids = self._finished_ids, []
        out.preempted_seq_ids[:0], self._resend_preempted = self._resend_preempted, []
        self._records.append(self._record(step, bool(forks)))
        self._attach_masks(out, sampled + [child for child, _ in forks])
        return out

    @staticmethod
    def _record(step: _Step, forked: bool) -> _Record:
        swapped_out = [seq for seq in step.preempted if seq.status is SequenceStatus.SWAPPED]
        return _Record(step.scheduled, forked, out=step.out, swapped_out=swapped_out)

    def abandon_steps(self) -> tuple[set[Sequence], list[Sequence]]:
        """After a step failed (in scheduling, on the device or taking its output back): every
        step whose output was not taken back is given up. Returns (the sequences whose state it
        may have left half-changed — what it computed or forked, and what it swapped out, for
        their KV may never have reached host memory —, the sequences the scheduler ended on its
        own meanwhile). The caller ends the first set's requests; the rest of the engine goes
        on. What the runner was to be told (finished and preempted sequences) and the blocks it
        was to zero are sent again with the next step: applying them twice is harmless."""
        victims: set[Sequence] = set()
        for record in self._records:
            victims.update(item.seq for item in record.scheduled)
            victims.update(record.swapped_out)
            if record.out is not None:
                self._finished_ids[:0] = record.out.finished_seq_ids
                self._resend_preempted += record.out.preempted_seq_ids
                self.block_manager.requeue_zero(record.out.blocks_to_zero, record.out.host_blocks_to_zero)
        self._records.clear()
        ended, self._ended = self._ended, []
        return victims, ended

    # ---- async scheduling ----------------------------------------------------------------------
    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled while the last one's output is still out: the
        pool holds every running sequence's next tokens (a burst's, plus a copy-on-write block
        each) above the watermark, so the step cannot preempt — a sequence whose tokens are
        placeholders is never preempted (`_preempt`). Admissions and swap-ins never preempt;
        they take only what is left."""
        bm, steps = self.block_manager, self.planner.max_steps
        need = sum(bm.blocks_for(seq.num_tokens + steps) - len(bm.tables.get(seq.seq_id, ())) + 1 for seq in self.running)
        return bm.num_free_blocks - need >= self.watermark_blocks

    def defer_last(self) -> bool:
        """Advance the sequences of the step just scheduled as if its output were back, so the
        next step can be scheduled before it is; False (nothing changed) when the step does not
        qualify. Each gets its progress and one placeholder per token the step gives it."""
        record = self._records[-1]
        items = [item for item in record.scheduled if not item.seq.finished]
        if (not self.planner.async_scheduling or record.forked or not items
                or not all(not item.num_spec and self.planner.overlappable(item.seq) for item in items)):
            return False
        for item in items:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens + max(item.token_budget - 1, 0)
            seq.token_ids.extend([PENDING_TOKEN] * item.token_budget)
            seq.num_pending = item.token_budget
        record.deferred = True
        self.num_deferred_steps += 1
        return True

    def _describe(self, step: _Step, forks: list[tuple[Sequence, int]]) -> None:
        """What the runner is told of each sequence the step computes or forks: the whole
        sequence if it does not hold it, else what changed since it last saw it."""
        tables, out = self.block_manager.tables, step.out
        for seq, parent in [(item.seq, None) for item in step.scheduled] + forks:
            described = self.mirror.describe(seq, tables[seq.seq_id], parent)
            (out.updates if isinstance(described, SequenceUpdate) else out.new_seqs).append(described)

    def _plan_burst(self, step: _Step) -> None:
        """Make a step whose sequences all sample (none forked) a burst (several tokens each:
        multi-step greedy steps or fused speculation cycles; or one greedy step whose argmax the
        fused call takes) when nothing waits to be admitted and the planner says so, reserving the
        positions; when they do not fit, its fallback budget (blocks already added stay in the
        tables for the tokens to come)."""
        out = step.out
        seqs = [item.seq for item in step.scheduled]
        if self.waiting or self.swapped or step.preempted or out.blocks_to_swap_in:
            return
        burst = self.planner.burst(seqs, step.fusing)
        if burst is None:
            return
        budget = burst.budget if burst.budget == burst.fallback or self._reserve(seqs, burst.budget, out) else burst.fallback
        greedy = not step.fusing and (budget > 1 or self.planner.fused_argmax)
        if budget > 1 or greedy:
            out.greedy_burst = greedy
            for chunk in out.chunks:
                chunk.token_budget, chunk.max_proposals = budget, burst.max_proposals

    def _reserve(self, seqs: list[Sequence], slots: int, out: SchedulerOutput) -> bool:
        """Slots for `slots` positions from each sequence's first uncomputed one, or False when one
        does not fit (blocks already added stay in the tables for the tokens to come)."""
        for seq in seqs:
            copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, slots)
            if copies is None:
                return False
            out.blocks_to_copy.extend(copies)
        return True

    def _attach_masks(self, out: SchedulerOutput, sampled: list[Sequence]) -> None:
        """The grammar masks of this step's constrained samples, computed in one batch."""
        constrained = [seq for seq in sampled if seq.grammar is not None]
        if constrained:
            masks = self.structured.bitmasks([seq.grammar for seq in constrained])
            out.allowed_tokens = {seq.seq_id: mask for seq, mask in zip(constrained, masks)}

    def _fork_samples(self, item: ScheduledSequence) -> list[Sequence]:
        """The request's other samples, once its first sample's prompt is computed: they share
        every block (the partly filled last one is copied on write) and start RUNNING."""
        seq, request = item.seq, item.seq.request
        if request.forked or request.params.best_of == 1:
            return []
        request.forked = True
        children = []
        for index in range(1, request.params.best_of):
            child = Sequence(request, index, list(seq.token_ids))
            child.num_computed_tokens = child.num_draft_computed = seq.num_computed_tokens + item.num_new_tokens
            child.grammar = seq.grammar.deep_copy() if seq.grammar is not None else None
            child.set_status(SequenceStatus.RUNNING)
            self.block_manager.fork(seq.seq_id, child.seq_id)
            request.seqs.append(child)
            self.live[child.seq_id] = child
            self.running.append(child)
            children.append(child)
        return children

    def update_from_output(self, output: ModelRunnerOutput, on_token: TokenCallback) -> list[Sequence]:
        """Advance what the last `schedule()` computed and append the sampled tokens; returns
        every sequence that changed (advanced, got a token, or ended).

        A decode that verified speculative tokens computed only the accepted ones: its progress
        grows by 1 + accepted, and the KV written for rejected proposals is simply overwritten
        later (its slots stay in the sequence's table). A multi-step decode computed one position
        per token it was given back but the last. A deferred step (`defer_last`) advanced
        already: its placeholders give way to the tokens. A sequence that ended since its step
        was scheduled (a stop rule of the step before, an abort) takes nothing."""
        record = self._records[0]  # left in place until its output is in: abandon_steps() finds it
        changed: dict[int, Sequence] = {}
        for item in record.scheduled:
            seq = item.seq
            if seq.finished:
                continue
            changed[seq.seq_id] = seq
            tokens = output.sampled.get(seq.seq_id, [])
            if item.num_spec:
                self.spec_stats.record(item.num_spec, min(max(len(tokens) - 1, 0), item.num_spec))
            for proposed, accepted in output.spec_cycles.get(seq.seq_id, ()):
                self.spec_stats.record(proposed, accepted)
            # Positions computed past the chunk's known tokens: every token given back but the
            # last (accepted proposals, or a multi-step or fused burst's tokens).
            extra = max(len(tokens) - 1, 0)
            if record.deferred:
                seq.drop_pending()
            else:
                seq.num_computed_tokens += item.num_new_tokens - item.num_spec + extra
            seq.num_draft_computed = output.draft_computed.get(seq.seq_id, seq.num_draft_computed)
            # (a copy only when a burst computed positions past the tokens appended so far)
            computed_ids = seq.token_ids + [t.token_id for t in tokens[:extra]] if extra else seq.token_ids
            self.block_manager.cache_full_blocks(seq.seq_id, computed_ids, self._num_publishable(seq))
            self._append(seq, tokens, on_token)
            seq.spec_token_ids = output.spec_token_ids.get(seq.seq_id, []) if not seq.finished else []
        for seq_id, tokens in output.sampled.items():
            seq = self.live.get(seq_id)
            if seq is not None and seq_id not in changed:  # a sample forked this step
                changed[seq_id] = seq
                self._append(seq, tokens, on_token)
        self._records.popleft()
        changed.update((seq.seq_id, seq) for seq in self._ended)
        self._ended = []
        return list(changed.values())

    def _num_publishable(self, seq: Sequence) -> int:
        """Positions whose KV is complete: the target's, and the draft model's where there is one
        (it keeps its KV in the same blocks, lags while speculation pauses, and a prefix-cache hit
        counts as both)."""
        if self._draft_kv:
            return min(seq.num_computed_tokens, seq.num_draft_computed)
        return seq.num_computed_tokens

    def _append(self, seq: Sequence, tokens: list[SampledToken], on_token: TokenCallback) -> None:
        for token in tokens:
            if seq.finished:
                return
            seq.token_ids.append(token.token_id)
            status = on_token(seq, token)
            if status is None and seq.grammar is not None:
                status = _advance_grammar(seq, token.token_id)
            if status is not None:
                self.finish(seq, status)

    def _chunk(self, num_new: int, budget: int) -> int:
        """How many of `num_new` known tokens to compute now: all when they fit the budget and
        the per-sequence cap, else (with chunked prefill) as many as both allow."""
        cap = self.config.long_prefill_token_threshold
        if cap and num_new > cap:
            num_new, budget = cap, min(cap, budget)  # the cap needs chunked prefill (EngineConfig)
        if num_new <= budget:
            return num_new
        return budget if self.config.enable_chunked_prefill else 0

    def _plan(self, seq: Sequence, budget: int, fusing: bool, reserved: int = 0) -> tuple[int, int]:
        """(tokens to compute, proposals verified among them): a decode also verifies its
        proposals, as many as the planner allows within the budget less `reserved` (the tokens
        kept for the decodes still to come)."""
        num_new = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
        num_spec = self.planner.num_to_verify(seq, budget - reserved, fusing) if num_new == 1 else 0
        return num_new + num_spec, num_spec

    def _schedule_running(self, step: _Step, budget: int) -> int:
        """Decodes first, in keep order, then prefill chunks by priority and arrival. `pending`
        holds the running sequences in keep order: victims are popped from its end, skipping
        those already scheduled (`done`), so a victim is never one scheduled earlier this step."""
        pending = sorted(self.running, key=self._keep_key)
        decodes = [seq for seq in pending if not seq.is_prefill]
        prefills = sorted((seq for seq in pending if seq.is_prefill), key=self._arrival_key)
        done: set[int] = set()
        for index, seq in enumerate(decodes):
            budget = self._schedule_one(step, seq, budget, pending, done, reserved=len(decodes) - index - 1)
        for seq in prefills:
            budget = self._schedule_one(step, seq, budget, pending, done)
        self.running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]
        return budget

    def _schedule_one(self, step: _Step, seq: Sequence, budget: int, pending: list[Sequence], done: set[int],
                      reserved: int = 0) -> int:
        """Schedule one running sequence if the budget and the pool allow, preempting the least
        worth keeping of `pending` (itself at worst) while its blocks do not fit; returns the
        budget left. `reserved`: tokens kept for the decodes after it."""
        if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
            return budget
        if seq.num_pending and tokens_left(seq, self.config.max_model_len) <= 0:
            return budget  # its tokens on the device are its last: it ends when they are back
        if self._exceeds_pool(seq):
            self._end_for_capacity(seq)  # ended: never a victim (not RUNNING)
            return budget
        num_new, num_spec = self._plan(seq, budget, step.fusing, reserved)
        slots = num_new + self.planner.lookahead_slots(seq)
        if num_new == 0 or not self._fits_step(step, seq.num_computed_tokens + slots):
            return budget  # no budget left this step; it keeps its blocks
        copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, slots)
        while copies is None:
            victim = pending.pop()
            if victim.seq_id in done or victim.status is not SequenceStatus.RUNNING:
                continue
            self._preempt(victim, step)
            if victim is seq:
                return budget
            copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, slots)
        done.add(seq.seq_id)
        step.out.blocks_to_copy.extend(copies)
        step.scheduled.append(ScheduledSequence(seq, num_new, num_spec))
        step.num_blocks += len(self.block_manager.block_table(seq.seq_id))
        return budget - num_new

    def _schedule_swapped(self, step: _Step, budget: int) -> int:
        self.swapped.sort(key=self._keep_key)
        for seq in list(self.swapped):
            if budget <= 0 or not self._has_room_for(seq):
                break
            if self._exceeds_pool(seq):
                self._end_for_capacity(seq)
                continue
            if not self._adapter_fits(seq):
                continue
            extra = self.block_manager.blocks_for(seq.num_tokens) - len(self.block_manager.cpu_tables[seq.seq_id])
            if not self.block_manager.can_swap_in(seq.seq_id, max(extra, 0) + self._watermark_kept()):
                break
            self.swapped.remove(seq)
            step.out.blocks_to_swap_in.extend(self.block_manager.swap_in(seq.seq_id))
            seq.set_status(SequenceStatus.RUNNING)
            num_new, num_spec = self._plan(seq, budget, step.fusing)
            self.running.append(seq)
            if num_new:
                slots = num_new + self.planner.lookahead_slots(seq)
                copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, slots)
                if copies is None:  # no room for the lookahead slots: verify nothing this time
                    num_new, num_spec = num_new - num_spec, 0
                    copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
                assert copies == [], "swapped-in blocks are private and space was checked"
                step.scheduled.append(ScheduledSequence(seq, num_new, num_spec))
                budget -= num_new
        return budget

    def _schedule_waiting(self, step: _Step, budget: int) -> None:
        bm = self.block_manager
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if self._exceeds_pool(seq):
                self._end_for_capacity(seq)
                continue
            if not self._has_room_for(seq):
                break
            use_cache = seq.request.params.prompt_logprobs is None
            if not self._adapter_fits(seq):
                continue  # its adapter would be one too many this step; later requests may fit
            cached = bm.allocate_prefix(seq.seq_id, seq.token_ids, use_cache=use_cache, root=seq.request.lora_int_id)
            num_new = self._chunk(seq.num_tokens - cached, budget)
            fits = self._fits_step(step, cached + num_new)
            copies = bm.allocate_slots(seq.seq_id, cached, num_new) if num_new and fits else None
            if copies is None or bm.num_free_blocks < self._watermark_kept():
                bm.free(seq.seq_id)
                break
            if use_cache:
                bm.record_prefix_query(seq.num_tokens, cached)
            self.waiting.remove(seq)
            if seq.request.admission_index < 0:
                seq.request.admission_index = self._admissions
                self._admissions += 1
            seq.num_computed_tokens = seq.num_draft_computed = cached
            if not seq.request.forked:
                seq.request.num_cached_tokens = cached
            seq.set_status(SequenceStatus.RUNNING)
            self.running.append(seq)
            step.scheduled.append(ScheduledSequence(seq, num_new))
            step.num_blocks += len(bm.block_table(seq.seq_id))
            budget -= num_new

    @staticmethod
    def _seqs_of(seq: Sequence) -> int:
        """Sequences `seq` will run as: a request whose samples are not forked yet forks all of
        them once its first sample's prompt is computed (`_fork_samples`)."""
        return 1 if seq.request.forked else seq.request.num_samples

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether running `seq` keeps the running sequences' distinct adapters within max_loras
        (vLLM's rule): every step's adapters are then resident at once (lora/manager.py)."""
        lora_id = seq.request.lora_int_id
        if not lora_id or not self.config.max_loras:
            return True
        active = {other.request.lora_int_id for other in self.running} - {0}
        return lora_id in active or len(active) < self.config.max_loras

    def _has_room_for(self, seq: Sequence) -> bool:
        """Whether admitting or swapping in `seq` keeps the running sequences — counted with the
        samples their requests will still fork — within max_num_seqs (design 004-8)."""
        running = sum(self._seqs_of(other) for other in self.running)
        return running + self._seqs_of(seq) <= self.config.max_num_seqs

    # ---- preemption --------------------------------------------------------------------------
    def _watermark_kept(self) -> int:
        """Free blocks an admission or swap-in must leave: the watermark while anything runs
        (else nothing would make room, and the sequence is the only way forward)."""
        return self.watermark_blocks if self.running else 0

    def _preempt_under_watermark(self, step: _Step) -> None:
        """Design 000 Algorithm 2 phase 4: while fewer blocks than the watermark are free, preempt
        the least worth keeping — at the start of the step, before anything is scheduled, so the
        step's allocations rarely fail. The last running sequence is kept: preempting it would
        make room for nothing."""
        if not self.watermark_blocks:
            return
        keep = sorted(self.running, key=self._keep_key)
        while self.block_manager.num_free_blocks < self.watermark_blocks and len(keep) > 1:
            victim = keep.pop()
            self.running.remove(victim)
            self._preempt(victim, step)

    def _fits_step(self, step: _Step, num_tokens: int) -> bool:
        """Whether a sequence with `num_tokens` positions fits the step's block bound too."""
        limit = self.config.max_step_blocks
        return limit is None or step.num_blocks + self.block_manager.blocks_for(num_tokens) <= limit

    @property
    def capacity_blocks(self) -> int:
        """The most blocks one sequence can ever use: the pool, or the per-step bound."""
        return min(self.block_manager.num_blocks, self.config.max_step_blocks or self.block_manager.num_blocks)

    def _exceeds_pool(self, seq: Sequence) -> bool:
        return self.block_manager.blocks_for(seq.num_tokens) > self.capacity_blocks

    def _end_for_capacity(self, seq: Sequence) -> None:
        """A sequence longer than the whole pool can never run: end it rather than loop."""
        self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self._ended.append(seq)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        assert not seq.num_pending, "a sequence whose tokens are still on the device is preempted (can_schedule_ahead)"
        self.num_preemptions += 1
        seq.request.num_preemptions += 1
        step.preempted.append(seq)
        if self.config.preemption_mode == "swap":
            pairs = self.block_manager.swap_out(seq.seq_id)
            if pairs is not None:
                self.num_swap_outs += 1
                step.out.blocks_to_swap_out.extend(pairs)
                seq.set_status(SequenceStatus.SWAPPED)
                self.swapped.append(seq)
                return
        # recompute (or swap space exhausted): drop the KV, keep the tokens, start over later.
        step.out.preempted_seq_ids.append(seq.seq_id)
        self.mirror.forget(seq.seq_id)  # it comes back to the runner as a new sequence
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.spec_token_ids = []
        seq.set_status(SequenceStatus.WAITING)
        bisect.insort(self.waiting, seq, key=self._arrival_key)


def _advance_grammar(seq: Sequence, token: int) -> SequenceStatus | None:
    """Feed the sampled token to the sequence's grammar; the output ends where the grammar does."""
    if not seq.grammar.consume_token(token):
        logger.error("token %d was sampled outside request %s's grammar: %s", token, seq.request.request_id, seq.grammar.get_error())
        seq.stop_reason = "grammar error"
        return SequenceStatus.FINISHED_STOPPED
    return SequenceStatus.FINISHED_STOPPED if seq.grammar.is_stopped() else None


def _prompt_logprobs_request(item: ScheduledSequence) -> PromptLogprobsRequest | None:
    """Prompt positions of this chunk whose next-token logprob is still to be reported (positions
    reported before a preemption or a fork are not computed again)."""
    seq, request = item.seq, item.seq.request
    num = request.params.prompt_logprobs
    if num is None:
        return None
    start = max(seq.num_computed_tokens, len(request.prompt_logprobs) - 1)
    end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens - 1)
    if start >= end:
        return None
    return PromptLogprobsRequest(num, start, seq.token_ids[start + 1 : end + 1])
