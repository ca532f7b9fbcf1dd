"""The model runner's side of speculative decoding: verify this step's proposals, propose the next.

A decode chunk that carries k proposals is scored at its k + 1 rows and verified by rejection
sampling (spec_decode/rejection.py). After the step's tokens are known, every decode proposes up
to `num_speculative_tokens` tokens for the next step — from its own history (n-gram) or from
the draft model — as many as its length limits and reserved slots allow. The scheduler keeps
the proposals with the sequence and schedules them for verification.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

from pagedllm.config import ModelConfig
from pagedllm.step.scheduler_output import SampleRow, SchedulerOutput
from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_model import DraftModel, DraftRequest, proposal_row
from pagedllm.spec_decode.fused_cycles import CycleRequest, FusedCycles
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.spec_decode.rejection import VerifyBatch, VerifySpan
from pagedllm.layers.sampler import Sampler
from pagedllm.layers.small_matmul import MAX_ROWS
from pagedllm.models.fused_decode import FusedDecoder
from pagedllm.worker.kv_cache import KVCache
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.worker.staging import Staging


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: ModelConfig, max_model_len: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.draft = None
        if config.uses_draft_model:
            self.draft = DraftModel(config.model, target, max_model_len, dtype, device, config.draft_vocab_size,
                                    config.quantization, config.draft_p_min, config.draft_attention_window)
        self.draft_time_s = 0.0
        self.fused: FusedCycles | None = None  # whole greedy cycles in one call, when both models run fused

    @property
    def num_lookahead_slots(self) -> int:
        """Positions past a decode's chunk the draft model writes while proposing."""
        return self.config.num_speculative_tokens if self.draft is not None else 0

    def bytes_per_block(self) -> int:
        return self.draft.bytes_per_block(self.block_size) if self.draft is not None else 0

    def allocate(self, num_blocks: int, num_cpu_blocks: int, kernel_attention: bool, target: FusedDecoder | None) -> None:
        """The draft's mirror pool; fused cycles when the target's step and the draft's both run fused."""
        if self.draft is None:
            return
        self.draft.allocate(num_blocks, num_cpu_blocks, self.block_size, kernel_attention)
        if self.config.fused_cycles and target is not None and self.draft.model.fused is not None:
            self.fused = FusedCycles(target, self.draft.model.fused, self.config.num_speculative_tokens, self.block_size,
                                     self.draft.vocab, self.config.draft_p_min)

    @property
    def max_fused_seqs(self) -> int:
        """The most sequences one fused call takes (its verification is one fused step), or 0."""
        return MAX_ROWS // (self.config.num_speculative_tokens + 1) if self.fused is not None else 0

    @property
    def kv_caches(self) -> list[KVCache]:
        return [self.draft.kv_cache] if self.draft is not None else []

    def forget(self, seq_ids: list[int]) -> None:
        if self.draft is not None:
            self.draft.forget(seq_ids)

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

    # ---- fused cycles ------------------------------------------------------------------------
    def run_fused(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:
        """`sched.fused_spec_cycles` cycles for the step's greedy decodes; the output and the time
        the target's steps took."""
        requests = []
        for chunk, row in zip(sched.chunks, sched.samples):
            # the draft may already hold the newest token's KV (an engine-driven step proposed
            # from it); its first pass recomputes it, for the logits of proposal 1
            draft_start = min(chunk.draft_start, chunk.start)
            history = row.token_ids[draft_start:]
            left = self.max_model_len - len(row.token_ids)
            if row.params.max_tokens is not None:
                left = min(left, row.params.max_tokens - row.num_output_tokens)
            budget = min(left, sched.fused_spec_cycles * (self.config.num_speculative_tokens + 1))
            requests.append(CycleRequest(chunk.block_table, history, draft_start, budget))
        results, times = self.fused.run(requests, sched.fused_spec_cycles)
        self.draft_time_s += times.draft_s
        output = ModelRunnerOutput()
        for row, result in zip(sched.samples, results):
            ranked = row.params.logprobs == 0  # an argmax's rank is 1, and no alternatives were asked for
            output.sampled[row.seq_id] = [SampledToken(t, lp, 1, []) if ranked else SampledToken(t, lp)
                                          for t, lp in zip(result.tokens, result.logprobs)]
            output.draft_computed[row.seq_id] = result.draft_position
            output.spec_cycles[row.seq_id] = result.cycles
        return output, times.target_s

    # ---- proposals ---------------------------------------------------------------------------
    def propose(self, sched: SchedulerOutput, result: ModelRunnerOutput, sampler: Sampler,
                generator_for: Callable[[SampleRow], torch.Generator]) -> None:
        """Fill `result.spec_token_ids` (and, with a draft model, `result.draft_computed`)."""
        started = time.perf_counter()
        rows = {row.seq_id: row for row in sched.samples}
        if self.draft is None:
            if not sched.propose:
                return
            for chunk in sched.chunks:
                row = rows.get(chunk.seq_id)
                if chunk.is_decode and row is not None:
                    history = row.token_ids + [t.token_id for t in result.sampled.get(chunk.seq_id, [])]
                    cap = self._cap(row, history, capacity=None)
                    c = self.config
                    result.spec_token_ids[chunk.seq_id] = propose_ngram(history, cap, c.prompt_lookup_max, c.prompt_lookup_min)
            return
        requests = self._draft_requests(sched, result, rows)
        result.draft_computed.update({r.seq_id: r.start + len(r.tokens) for r in requests})
        result.spec_token_ids.update(self.draft.propose(requests, sampler, generator_for, self.block_size))
        self.draft_time_s += time.perf_counter() - started

    def _draft_requests(self, sched: SchedulerOutput, result: ModelRunnerOutput, rows: dict[int, SampleRow]) -> list[DraftRequest]:
        """Decodes catch up on what the target accepted and propose; prompt chunks only mirror.
        While the scheduler pauses proposals the draft skips decodes altogether (the point of the
        pause is to spend nothing on speculation), and its KV lags until they resume."""
        requests = []
        for chunk in sched.chunks:
            capacity = len(chunk.block_table) * self.block_size
            row = rows.get(chunk.seq_id)
            if chunk.is_decode and row is not None:
                if not sched.propose:
                    continue  # the draft catches up when proposals resume
                history = row.token_ids + [t.token_id for t in result.sampled.get(chunk.seq_id, [])]
                known, cap, row = history[chunk.draft_start:], self._cap(row, history, capacity), proposal_row(row)
            else:
                assert chunk.draft_start >= chunk.start, "the draft's KV never lags a prompt chunk's start"
                known, cap, row = chunk.token_ids[chunk.draft_start - chunk.start :], 0, None
            start = chunk.draft_start
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

    def _cap(self, row: SampleRow, history: list[int], capacity: int | None) -> int:
        """How many tokens the next step may verify: within max_tokens, within max_model_len
        (positions), and, for the draft model, within the slots it may write."""
        base = len(history) - 1  # position of the newest token
        cap = min(self.config.num_speculative_tokens, self.max_model_len - 1 - base)
        if row.params.max_tokens is not None:
            cap = min(cap, row.params.max_tokens - (len(history) - row.num_prompt_tokens) - 1)
        if capacity is not None:
            cap = min(cap, capacity - base)
        return max(0, int(cap))
