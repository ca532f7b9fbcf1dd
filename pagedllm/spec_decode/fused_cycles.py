"""Greedy draft-model speculation as whole cycles in one C call (layers/csrc/speculate.c).

Why: on a CPU a small model's decode step costs a fraction of a millisecond, and driving
speculation through the engine — a pass per proposal, each staged and sampled, then a
verification with its rejection bookkeeping — costs more than the steps it saves. When every
sequence of a step decodes greedily with nothing else asked of its tokens (the rows multi-step
scheduling takes), the tokens follow from argmaxes alone, so the draft's passes, the target's
verification and the acceptance run in one call per engine step, and with multi-step
scheduling several cycles per call. The tokens are those of greedy decoding without
speculation; everything else (sampling, n-gram proposals, grammars, logprobs beyond the chosen
token's) keeps the engine-driven path.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from pagedllm.layers import kernels
from pagedllm.layers.kernel_interface import Speculation as SpeculationStruct
from pagedllm.models.fused_decode import FusedDecoder


@dataclass
class CycleRequest:
    """One sequence: its newest token is at `position` (the target's KV is valid below it)."""

    block_table: list[int]  # covers every position the cycles may write (the scheduler reserved them)
    history: list[int]  # its tokens at draft_position .. position
    draft_position: int  # the draft's KV is valid below it
    budget: int  # the most tokens to produce

    @property
    def position(self) -> int:
        return self.draft_position + len(self.history) - 1


@dataclass
class CycleResult:
    tokens: list[int]
    logprobs: list[float]
    draft_position: int
    cycles: list[tuple[int, int]]  # (proposals verified, accepted) of each cycle that proposed


@dataclass
class CycleTimes:
    target_s: float
    draft_s: float


class FusedCycles:
    """Built once both models' fused decode steps exist (their KV pools bound)."""

    def __init__(self, target: FusedDecoder, draft: FusedDecoder, num_speculative_tokens: int, block_size: int,
                 draft_vocab: torch.Tensor | None, draft_p_min: float = 0.0):
        self.target, self.draft = target, draft
        self.k = num_speculative_tokens
        self.min_log_prob = math.log(draft_p_min) if draft_p_min > 0 else -math.inf
        self.block_size = block_size
        self.library = target.library
        self._vocab = draft_vocab.to(torch.int64).contiguous() if draft_vocab is not None else None

    def run(self, requests: list[CycleRequest], num_cycles: int) -> tuple[list[CycleResult], CycleTimes]:
        """Up to `num_cycles` cycles for every request (fewer once it has its budget). The
        arguments travel as ctypes arrays: a cycle is short enough that building tensors for
        them was a visible share of it (docs/engine.md)."""
        S, k = len(requests), self.k
        max_blocks = max(len(r.block_table) for r in requests)
        history_ld = max(len(r.history) for r in requests)
        out_ld = max(r.budget for r in requests)
        tables = _int64s([b for r in requests for b in r.block_table + [0] * (max_blocks - len(r.block_table))])
        history = _int64s([t for r in requests for t in r.history + [0] * (history_ld - len(r.history))])
        capacity = _int64s([len(r.block_table) * self.block_size for r in requests])
        budget = _int64s([r.budget for r in requests])
        position, draft_position = _int64s([r.position for r in requests]), _int64s([r.draft_position for r in requests])
        tokens, logprobs = (ctypes.c_int64 * (S * out_ld))(), (ctypes.c_float * (S * out_ld))()
        num_tokens = (ctypes.c_int64 * S)()
        proposed, accepted = (ctypes.c_int64 * (S * num_cycles))(), (ctypes.c_int64 * (S * num_cycles))()
        spec = SpeculationStruct(
            num_seqs=S, k=k, block_tables=_address(tables), max_blocks=max_blocks, capacity=_address(capacity),
            budget=_address(budget), history=_address(history), history_ld=history_ld, position=_address(position),
            draft_position=_address(draft_position), draft_vocab=self._vocab.data_ptr() if self._vocab is not None else None,
            tokens=_address(tokens), logprobs=_address(logprobs), out_ld=out_ld, num_tokens=_address(num_tokens),
            proposed=_address(proposed), accepted=_address(accepted), min_log_prob=self.min_log_prob,
        )
        target_key, draft_key = ("speculate", S * (k + 1)), ("speculate", S)
        plan = list(zip(self.target.threads.plan(target_key, num_cycles), self.draft.threads.plan(draft_key, num_cycles)))
        threads = (ctypes.c_int * (2 * num_cycles))(*[t for pair in plan for t in pair])
        seconds = (ctypes.c_double * (2 * num_cycles))()
        failed = self.library.speculate_greedy(ctypes.byref(self.target._struct), ctypes.byref(self.draft._struct),
                                               ctypes.byref(spec), num_cycles, threads, seconds)
        kernels.check_status(failed, self.library, "fused speculation")
        proposed_rows = [proposed[s * num_cycles : (s + 1) * num_cycles] for s in range(S)]
        accepted_rows = [accepted[s * num_cycles : (s + 1) * num_cycles] for s in range(S)]
        ran = max(sum(p >= 0 for p in row) for row in proposed_rows)  # cycles run (by the longest-running sequence)
        self.target.threads.record(target_key, [t for t, _ in plan[:ran]], seconds[0 : 2 * ran : 2])
        self.draft.threads.record(draft_key, [d for _, d in plan[:ran]], seconds[1 : 2 * ran : 2])
        results = []
        for s in range(S):
            first, n = s * out_ld, num_tokens[s]
            cycles = [(p, a) for p, a in zip(proposed_rows[s], accepted_rows[s]) if p > 0]
            results.append(CycleResult(tokens[first : first + n], logprobs[first : first + n], draft_position[s], cycles))
        return results, CycleTimes(sum(seconds[0 : 2 * ran : 2]), sum(seconds[1 : 2 * ran : 2]))


def _int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _address(array: ctypes.Array) -> int:
    return ctypes.addressof(array)
