"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw (unprocessed) distribution."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated (or prompt) token: the chosen token plus the top-N alternatives.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    status: str | None = None  # RequestState's value: queued, prefilling, decoding, preempted, completed, failed
    num_preemptions: int = 0


@dataclass
class BeamSearchSequence:
    """One hypothesis of a beam search (vLLM's shape): `tokens` and `text` include the prompt;
    `score` is what the search ranked it by (cumulative logprob / generated length ** length_penalty,
    transformers' `sequences_scores`)."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beam search result: `beam_width` hypotheses, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    """A prompt's pooled hidden state (worker/pooler.py): `embedding` has hidden_size floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput`: one prompt's embedding (`LLM.embed`, /v1/embeddings)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
