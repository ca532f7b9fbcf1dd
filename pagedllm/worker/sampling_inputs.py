"""A step's `SamplingMetadata`, built from its sample rows on the host and staged in one go.

Per-row factors go into a float array and every index (random rows, penalised tokens) into the
step's int64 array, so sampling adds no transfer of its own. Only rows that use a feature pay
for it: a batch of greedy rows stages nothing but its row count.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from pagedllm.layers.sampler import Penalties, SamplingMetadata, TokenChoices
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.staging import Staging

NO_TOP_K = np.iinfo(np.int64).max  # a row without top-k (the kernels read >= vocab as off)


@dataclass(slots=True)
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
class SamplingPlan:
    num_rows: int
    prefix: str = "sampling."  # names of its staged arrays
    random: list[int] = field(default_factory=list)  # rows that sample
    seeded: list[tuple[int, int]] = field(default_factory=list)  # (position among random rows, row)
    has_unseeded: bool = False
    filters: tuple[bool, bool, bool] = (False, False, False)  # top_k, top_p, min_p in use
    penalised: bool = False
    restricted: bool = False  # some rows have allowed_token_ids
    biased: bool = False  # some rows have a logit_bias
    constrained: bool = False  # some rows carry a grammar's mask
    max_num_logprobs: int | None = None


def stage_sampling(rows: list[SampleRow], staging: Staging, prefix: str = "sampling.") -> SamplingPlan:
    plan = SamplingPlan(len(rows), prefix)
    plan.random = [r for r, row in enumerate(rows) if not row.params.greedy]
    asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
    plan.max_num_logprobs = max(asked) if asked else None
    if plan.random:
        _stage_random(plan, rows, staging)
    _stage_token_choices(plan, rows, staging, prefix)
    if any(_penalised(row) for row in rows):
        plan.penalised = True
        _stage_penalties(rows, staging, prefix)
    constrained = [r for r, row in enumerate(rows) if row.allowed_tokens is not None]
    if constrained:
        plan.constrained = True
        staging.add(prefix + "allowed_rows", constrained)
        staging.add(prefix + "allowed", np.stack([rows[r].allowed_tokens for r in constrained]), np.int32)
    return plan


def _stage_random(plan: SamplingPlan, rows: list[SampleRow], staging: Staging) -> None:
    prefix = plan.prefix
    params = [rows[r].params for r in plan.random]
    staging.add(prefix + "random_rows", plan.random)
    plan.seeded = [(pos, r) for pos, r in enumerate(plan.random) if rows[r].params.seed is not None]
    unseeded = [pos for pos, r in enumerate(plan.random) if rows[r].params.seed is None]
    plan.has_unseeded = bool(unseeded)
    if unseeded:
        staging.add(prefix + "unseeded", unseeded)
    staging.add(prefix + "temperature", [p.temperature for p in params], np.float32)
    plan.filters = (any(p.top_k != -1 for p in params), any(p.top_p < 1.0 for p in params), any(p.min_p > 0 for p in params))
    if plan.filters[0]:
        staging.add(prefix + "top_k", [p.top_k if p.top_k != -1 else NO_TOP_K for p in params])
    if plan.filters[1]:
        staging.add(prefix + "top_p", [p.top_p for p in params], np.float32)
    if plan.filters[2]:
        staging.add(prefix + "min_p", [p.min_p for p in params], np.float32)


def _stage_token_choices(plan: SamplingPlan, rows: list[SampleRow], staging: Staging, prefix: str) -> None:
    """allowed_token_ids as the restricted rows and their (row, token) pairs; logit_bias as
    (row, token) pairs and their values."""
    restricted = [r for r, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if restricted:
        plan.restricted = True
        pairs = [(r, t) for r in restricted for t in rows[r].params.allowed_token_ids]
        staging.add(prefix + "restricted_rows", restricted)
        staging.add(prefix + "allowed_pairs", pairs, shape=(len(pairs), 2))
    biased = [(r, t, b) for r, row in enumerate(rows) for t, b in (row.params.logit_bias or {}).items()]
    if biased:
        plan.biased = True
        staging.add(prefix + "bias_pairs", [(r, t) for r, t, _ in biased], shape=(len(biased), 2))
        staging.add(prefix + "bias_values", [b for _, _, b in biased], np.float32)


def _penalised(row: SampleRow) -> bool:
    p = row.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty) or row.num_output_tokens < p.min_tokens


def _stage_penalties(rows: list[SampleRow], staging: Staging, prefix: str) -> None:
    seen: list[tuple[int, int]] = []
    output: list[tuple[int, int]] = []
    banned: list[tuple[int, int]] = []
    for r, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen.extend((r, t) for t in set(row.token_ids))
        if p.presence_penalty or p.frequency_penalty:
            output.extend((r, t) for t in row.token_ids[row.num_prompt_tokens :])
        if row.num_output_tokens < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else row.eos_token_ids)
            banned.extend((r, t) for t in sorted(ids))
    factors = [[row.params.repetition_penalty, row.params.presence_penalty, row.params.frequency_penalty] for row in rows]
    staging.add(prefix + "penalty_factors", factors, np.float32, shape=(len(rows), 3))
    for name, pairs in (("seen", seen), ("output", output), ("banned", banned)):
        staging.add(prefix + name, pairs, shape=(len(pairs), 2))


def sampling_metadata(plan: SamplingPlan, views: dict[str, torch.Tensor], generator_for: Callable[[int], torch.Generator]) -> SamplingMetadata:
    """`generator_for(row)`: the seeded row's own generator (the runner keeps them)."""
    meta = SamplingMetadata(plan.num_rows, max_num_logprobs=plan.max_num_logprobs)
    prefix = plan.prefix
    if plan.random:
        meta.random_rows = views[prefix + "random_rows"]
        meta.temperature = views[prefix + "temperature"]
        meta.unseeded = views.get(prefix + "unseeded")
        meta.seeded = [(pos, generator_for(row)) for pos, row in plan.seeded]
        meta.top_k, meta.top_p, meta.min_p = (views.get(prefix + name) for name in ("top_k", "top_p", "min_p"))
    if plan.penalised:
        factors = views[prefix + "penalty_factors"]
        pairs = {name: (views[prefix + name][:, 0], views[prefix + name][:, 1]) for name in ("seen", "output", "banned")}
        meta.penalties = Penalties(factors[:, 0], factors[:, 1], factors[:, 2], pairs["seen"], pairs["output"], pairs["banned"])
    if plan.restricted or plan.biased:
        allowed = views.get(prefix + "allowed_pairs")
        bias = views.get(prefix + "bias_pairs")
        meta.choices = TokenChoices(views.get(prefix + "restricted_rows"),
                                    (allowed[:, 0], allowed[:, 1]) if allowed is not None else None,
                                    (bias[:, 0], bias[:, 1]) if bias is not None else None,
                                    views.get(prefix + "bias_values"))
    if plan.constrained:
        meta.allowed = (views[prefix + "allowed_rows"], views[prefix + "allowed"])
    return meta

