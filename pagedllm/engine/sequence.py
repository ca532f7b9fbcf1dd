"""Request and sequence state (sequence state and the request lifecycle).

A `Request` is what a user submitted; it owns one `Sequence` per sample (n / best_of). Only the
first sequence is prefilled: the others are forked from it once its prompt is computed, sharing
its KV blocks. Scheduling works on sequences, so each sample can be preempted on its own.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from pagedllm.outputs import PromptLogprobs, RequestMetrics, SampleLogprobs
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self._finished  # set below: asked for every sequence at every step, an enum hash is slow


class RequestState(enum.Enum):
    """A request's state as the platform's data model names it (InferenceRequest.status),
    derived from its samples' sequence states (`Request.state`)."""

    QUEUED = "queued"  # waiting to be admitted for the first time
    PREFILLING = "prefilling"  # its prompt (or a recomputed context) is being computed
    DECODING = "decoding"
    PREEMPTED = "preempted"  # swapped out, or waiting to be recomputed
    COMPLETED = "completed"  # finished: a stop rule, its length, or an abort
    FAILED = "failed"  # the engine failed while it ran (finish reason "error")


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
for _status in SequenceStatus:
    _status._finished = _status in _FINISHED

# The sequence state diagram, plus RUNNING -> WAITING for recompute preemption.
_TRANSITIONS = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_LENGTH},
    SequenceStatus.RUNNING: {SequenceStatus.SWAPPED, SequenceStatus.WAITING, *_FINISHED},
    SequenceStatus.SWAPPED: {SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED},
}

_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample's tokens, KV progress and stop state. `token_ids` is prompt + output."""

    request: "Request"
    index: int
    token_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: SampleLogprobs = field(default_factory=list)
    output_text: str = ""
    stop_reason: int | str | None = None
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify at the next step
    grammar: Any = None  # the structured-output matcher (llguidance), when the output is constrained
    num_draft_computed: int = 0  # positions whose draft-model KV is valid (speculative decoding)
    # Async scheduling: how many of `token_ids` are placeholders (PENDING_TOKEN) for tokens a step
    # still running on the device will sample; they count as output for planning (max_tokens)
    num_pending: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens sampled so far; never a placeholder of a token still on the device."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_pending]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status._finished

    def drop_pending(self) -> None:
        """Remove the placeholders of tokens still on the device (their real values are being
        taken back, or the sequence ended and they will never be)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    def set_status(self, status: SequenceStatus) -> None:
        assert status in _TRANSITIONS.get(self.status, ()), f"illegal transition {self.status} -> {status}"
        self.status = status

    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclass(eq=False)
class Request:
    """A user's request: the prompt, its sampling parameters and its samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    forked: bool = False
    num_preemptions: int = 0  # times one of its samples was preempted
    admission_index: int = -1  # the order in which the scheduler first admitted it (-1: not yet)
    error: str | None = None  # why the engine failed it (its samples then finish with reason "error")
    lora_request: Any = None  # the LoRARequest of its adapter (lora/request.py); None: the base model
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model: the prefix cache's hash root for its blocks."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_samples(self) -> int:
        """Sequences the request will run at once (the scheduler admits it only with room for all)."""
        return self.params.best_of

    @property
    def state(self) -> RequestState:
        if self.error is not None:
            return RequestState.FAILED
        if self.finished:
            return RequestState.COMPLETED
        running = [s for s in self.seqs if s.status is SequenceStatus.RUNNING]
        if running:
            return RequestState.PREFILLING if any(s.is_prefill for s in running) else RequestState.DECODING
        return RequestState.PREEMPTED if self.num_preemptions else RequestState.QUEUED

    @property
    def finished(self) -> bool:
        # Before the fork only the first sample exists, and the fork happens before its first
        # token is sampled, so "all samples finished" holds at every point of the lifecycle.
        for seq in self.seqs:
            if not seq.status._finished:
                return False
        return True
