"""The model runner's side of speculative decoding: verify this step's proposals, propose the next.

A decode chunk that carries k proposals is scored at its k + 1 rows and verified by rejection
sampling (spec_decode/rejection.py). After the step's tokens are known, every decode proposes up
to its `max_proposals` for the next step — from its own history (n-gram) or from the draft
model — as many as its length limits and reserved slots allow. The speculator keeps the
proposals (and where each sequence's draft KV ends) between steps; the scheduler is told how
many were made and schedules them for verification. A step the planner fills with fused
greedy cycles runs them in one call (`run_fused`, spec_decode/fused_cycles.py).

The model runner calls into a speculator it is given (engine/llm_engine.py builds it); it
imports nothing of this package, which builds on the runner's pieces (staging, batch layout).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from pagedllm.models.fused_decode import FusedDecoder
from pagedllm.spec_decode.draft_model import DraftModel, DraftRequest, proposal_row
from pagedllm.spec_decode.fused_cycles import CycleRequest, FusedCycles
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.spec_decode.rejection import VerifyBatch, VerifySpan, rejection_sample
from pagedllm.step.planner import StepPlanner
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.step.scheduler_output import SchedulerOutput
from pagedllm.worker.input_batch import BatchChunk
from pagedllm.worker.kv_cache import KVCache
from pagedllm.worker.sampling_inputs import SampleRow
from pagedllm.worker.staging import Staging


class Speculator:
    def __init__(self, planner: StepPlanner, target: ModelConfig, max_model_len: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.planner = planner
        self.config = config = planner.speculation
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.draft = None
        if config.uses_draft_model:
            self.draft = DraftModel(config.model, target, max_model_len, dtype, device, planner, config.draft_vocab_size,
                                    config.quantization, config.draft_p_min, config.draft_attention_window)
        self.draft_time_s = 0.0  # proposing
        self.target_time_s = 0.0  # in the target's steps (the runner's, and the fused cycles')
        self.fused: FusedCycles | None = None  # whole greedy cycles in one call, when both models run fused
        self.pending: dict[int, list[int]] = {}  # seq id -> the proposals its next step verifies
        self.draft_start: dict[int, int] = {}  # seq id -> the first position whose draft KV is not valid

    def bytes_per_block(self) -> int:
        return self.draft.bytes_per_block(self.block_size) if self.draft is not None else 0

    def allocate(self, num_blocks: int, num_cpu_blocks: int, target: FusedDecoder | None) -> None:
        """The draft's mirror pool; fused cycles when the planner runs them (both models fused)."""
        if self.draft is None:
            return
        self.draft.allocate(num_blocks, num_cpu_blocks, self.block_size, self.planner.draft_kernel_attention)
        if self.planner.fused_spec_cycles:
            self.fused = FusedCycles(target, self.draft.model.fused, self.config.num_speculative_tokens, self.block_size,
                                     self.draft.vocab, self.config.draft_p_min)

    @property
    def kv_caches(self) -> list[KVCache]:
        return [self.draft.kv_cache] if self.draft is not None else []

    def apply(self, sched: SchedulerOutput) -> None:
        """Sequences that finished or lost their KV take their proposals and draft KV with them;
        a new one's draft KV is valid where its target's is (a prefix-cache hit counts as both)."""
        gone = sched.finished_seq_ids + sched.preempted_seq_ids
        for seq_id in gone:
            self.pending.pop(seq_id, None)
            self.draft_start.pop(seq_id, None)
        if self.draft is not None:
            self.draft.forget(gone)
        for seq in sched.new_seqs:
            self.draft_start[seq.seq_id] = seq.num_computed_tokens

    def proposals(self, seq_id: int) -> list[int]:
        """What the sequence proposed at its last step (its chunk verifies some of them)."""
        return self.pending.get(seq_id, [])

    # ---- verification ------------------------------------------------------------------------
    @staticmethod
    def expand(rows: list[SampleRow]) -> list[SampleRow]:
        """One row per scored position: row j of a sequence sees its history plus proposals
        1..j (penalties and min_tokens depend on it)."""
        return [replace(row, token_ids=row.token_ids + row.spec_token_ids[:j], spec_token_ids=[])
                for row in rows for j in range(len(row.spec_token_ids) + 1)]

    @staticmethod
    def stage_verify(rows: list[SampleRow], staging: Staging) -> None:
        proposals, row_span, row_offset, first_rows = [], [], [], []
        for span, row in enumerate(rows):
            first_rows.append(len(proposals))
            proposals += row.spec_token_ids + [-1]
            row_span += [span] * (len(row.spec_token_ids) + 1)
            row_offset += list(range(len(row.spec_token_ids) + 1))
        staging.add("verify.proposals", proposals)
        staging.add("verify.row_span", row_span)
        staging.add("verify.row_offset", row_offset)
        staging.add("verify.first_rows", first_rows)
        staging.add("verify.random", [0 if row.params.greedy else 1 for row in rows])

    def verify_batch(self, rows: list[SampleRow], views: dict[str, torch.Tensor], generator_for: Callable[[SampleRow], torch.Generator]) -> VerifyBatch:
        spans = []
        first = 0
        for row in rows:
            greedy = row.params.greedy
            draft_probs = self.draft.probs.get(row.seq_id) if self.draft is not None and not greedy else None
            generator = generator_for(row) if not greedy and row.params.seed is not None else None
            spans.append(VerifySpan(first, len(row.spec_token_ids), greedy, generator, draft_probs))
            first += len(row.spec_token_ids) + 1
        return VerifyBatch(spans, views["verify.proposals"], views["verify.row_span"], views["verify.row_offset"],
                           views["verify.first_rows"], views["verify.random"].bool())

    @staticmethod
    def sample_verified(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, batch: VerifyBatch) -> SamplerOutput:
        """Each verified row's accepted tokens, by the rejection rule."""
        return rejection_sample(sampler, logits, meta, batch)

    # ---- fused cycles ------------------------------------------------------------------------
    def run_fused(self, chunks: list[BatchChunk], rows: list[SampleRow], budget: int) -> ModelRunnerOutput:
        """Fused cycles for a step's greedy decodes (each samples: `rows` match `chunks`), as
        many as `budget` positions from each chunk's start hold, each sequence producing at
        most `budget` tokens (and no more than its limits allow)."""
        requests = []
        for chunk, row in zip(chunks, rows):
            # the draft may already hold the newest token's KV (an engine-driven step proposed
            # from it); its first pass recomputes it, for the logits of proposal 1
            draft_start = min(self.draft_start[chunk.seq_id], chunk.start)
            history = row.token_ids[draft_start:]
            left = self.max_model_len - len(row.token_ids)
            if row.params.max_tokens is not None:
                left = min(left, row.params.max_tokens - row.num_output_tokens)
            requests.append(CycleRequest(chunk.block_table, history, draft_start, min(left, budget)))
        results, times = self.fused.run(requests, budget // (self.config.num_speculative_tokens + 1))
        self.draft_time_s += times.draft_s
        self.target_time_s += times.target_s
        output = ModelRunnerOutput()
        for row, result in zip(rows, results):
            ranked = row.params.logprobs == 0  # an argmax's rank is 1, and no alternatives were asked for
            output.sampled[row.seq_id] = [SampledToken(t, lp, 1, []) if ranked else SampledToken(t, lp)
                                          for t, lp in zip(result.tokens, result.logprobs)]
            output.draft_computed[row.seq_id] = self.draft_start[row.seq_id] = result.draft_position
            output.spec_cycles[row.seq_id] = result.cycles
            self.pending.pop(row.seq_id, None)
        return output

    # ---- proposals ---------------------------------------------------------------------------
    def propose(self, chunks: list[BatchChunk], rows: list[SampleRow], max_proposals: list[int], result: ModelRunnerOutput,
                sampler: Sampler, generator_for: Callable[[SampleRow], torch.Generator]) -> None:
        """Fill `result.spec_token_ids` (and, with a draft model, `result.draft_computed`): each
        decode proposes up to its `max_proposals` (0: speculation paused for it)."""
        started = time.perf_counter()
        by_seq = {row.seq_id: row for row in rows}
        if self.draft is None:
            for chunk, most in zip(chunks, max_proposals):
                row = by_seq.get(chunk.seq_id)
                if chunk.is_decode and row is not None and most:
                    history = row.token_ids + [t.token_id for t in result.sampled.get(chunk.seq_id, [])]
                    cap = self._cap(row, history, most, capacity=None)
                    c = self.config
                    result.spec_token_ids[chunk.seq_id] = propose_ngram(history, cap, c.prompt_lookup_max, c.prompt_lookup_min)
        else:
            requests = self._draft_requests(chunks, max_proposals, result, by_seq)
            result.draft_computed.update({r.seq_id: r.start + len(r.tokens) for r in requests})
            self.draft_start.update(result.draft_computed)
            result.spec_token_ids.update(self.draft.propose(requests, sampler, generator_for, self.block_size))
            self.draft_time_s += time.perf_counter() - started
        for chunk in chunks:
            self.pending[chunk.seq_id] = result.spec_token_ids.get(chunk.seq_id, [])

    def _draft_requests(self, chunks: list[BatchChunk], max_proposals: list[int], result: ModelRunnerOutput,
                        rows: dict[int, SampleRow]) -> list[DraftRequest]:
        """Decodes catch up on what the target accepted and propose; prompt chunks only mirror.
        While the scheduler pauses proposals the draft skips decodes altogether (the point of the
        pause is to spend nothing on speculation), and its KV lags until they resume."""
        requests = []
        for chunk, most in zip(chunks, max_proposals):
            capacity = len(chunk.block_table) * self.block_size
            row = rows.get(chunk.seq_id)
            draft_start = self.draft_start[chunk.seq_id]
            if chunk.is_decode and row is not None:
                if not most:
                    continue  # the draft catches up when proposals resume
                history = row.token_ids + [t.token_id for t in result.sampled.get(chunk.seq_id, [])]
                known, cap, row = history[draft_start:], self._cap(row, history, most, capacity), proposal_row(row)
            else:
                assert draft_start >= chunk.start, "the draft's KV never lags a prompt chunk's start"
                known, cap, row = chunk.token_ids[draft_start - chunk.start :], 0, None
            start = draft_start
            if row is None and self.draft.reach is not None and len(known) > self.draft.reach:
                # a windowed draft never reads a prompt's KV further back than its reach from the
                # chunk's end (nor does anything that follows): those slots stay as they are
                start, known = chunk.end - self.draft.reach, known[len(known) - self.draft.reach :]
            tokens = known[: max(0, capacity - start)]
            if len(tokens) < len(known):
                cap = 0  # not every known token fits the reserved slots: catch up only
            if tokens:
                requests.append(DraftRequest(chunk.seq_id, start, tokens, chunk.block_table, cap, row))
        return requests

    def _cap(self, row: SampleRow, history: list[int], most: int, capacity: int | None) -> int:
        """How many tokens the next step may verify: at most `most`, within max_tokens, within
        max_model_len (positions), and, for the draft model, within the slots it may write."""
        base = len(history) - 1  # position of the newest token
        cap = min(most, self.max_model_len - 1 - base)
        if row.params.max_tokens is not None:
            cap = min(cap, row.params.max_tokens - (len(history) - row.num_prompt_tokens) - 1)
        if capacity is not None:
            cap = min(cap, capacity - base)
        return max(0, int(cap))
