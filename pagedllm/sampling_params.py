"""Per-request sampling parameters (vLLM's names and defaults), validated on construction."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
# Ranges beyond which a value only breaks the float32 arithmetic of sampling: a temperature or a
# penalty of 1e308 is inf in float32 (-inf / inf is NaN), a top_p or a penalty of 1e-300 is 0
# (every token dropped, or a division by 0), and the sampled row is then NaN (token 0 each time).
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6
PENALTY_RANGE = (0.01, 100.0)
# top_k at or above the vocabulary keeps every token; the bound keeps it a 32-bit integer for the
# sampler's tensors (2**63 once overflowed their staging and failed the step).
MAX_TOP_K = 2**31 - 1
# Beam scores divide by length ** length_penalty: beyond +-10 the power overflows a float at long
# lengths (2000 raised OverflowError out of the search) and the ranking no longer changes anyway.
MAX_LENGTH_PENALTY = 10.0
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token in effect, 100 forces it
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.Enum):
    """Which outputs the engine's `step()` reports for a request (vLLM's names and values):
    every step's whole output so far, or only the final one (what `LLM.generate` asks for: no
    snapshot of an unfinished request is built, so a long batch does not copy every sequence's
    tokens and logprobs at every step). DELTA (only what is new) is not built."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, any JSON object, a regular expression, one of some
    strings, or a Lark grammar (vLLM's `structured_outputs`); exactly one of them."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: need exactly one of {list(_CONSTRAINTS)}, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs: json is not a valid JSON schema document: {exc}") from exc
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs: json must be a JSON schema object")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs: choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs: {name} must be a non-empty string")


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # added to the logits before sampling (greedy too), by token id (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # only these tokens may be sampled (vLLM's allowed_token_ids)
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        self._validate()

    def _validate(self) -> None:
        _int_at_least("n", self.n, 1)
        _int_at_least("best_of", self.best_of, 1)
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be <= {MAX_TEMPERATURE:g} (any higher is uniform sampling), got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(f"top_p must be in (0, 1] and at least {MIN_TOP_P:g} (smaller rounds to 0), got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be <= {MAX_TOP_K} (any value at or above the vocabulary size keeps every token), "
                             f"got {self.top_k}")
        _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        low, high = PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} and max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_at_least(name, value, 0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY, got {self.output_kind!r} "
                             "(DELTA outputs are not supported)")
        self._validate_token_choices()

    def _validate_token_choices(self) -> None:
        """logit_bias: {token id: bias in [-100, 100]}; allowed_token_ids: a non-empty list of
        token ids. (Whether the ids are in the vocabulary is the engine's check.)"""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            low, high = LOGIT_BIAS_RANGE
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
                    raise ValueError(f"logit_bias values must be numbers in [{low:g}, {high:g}], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be token ids (integers >= 0)")
            self.allowed_token_ids = list(self.allowed_token_ids)

    @property
    def restricts_tokens(self) -> bool:
        """Whether logit_bias or allowed_token_ids change this request's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's `BeamSearchParams`): keep the `beam_width` most likely continuations
    at every step, scored as transformers' `num_beams` generate scores them — cumulative logprob
    divided by generated length ** `length_penalty`, and `early_stopping` as transformers has it —
    so the results equal transformers' for the same weights. Deterministic: `temperature` must be 0.

    early_stopping: True stops as soon as `beam_width` hypotheses have finished; False (the
    default, transformers' too) stops once the best running beam, scored at its current length,
    cannot beat the worst kept hypothesis; "never" scores it at `max_tokens` instead when
    length_penalty > 0 (the exact bound), so the search goes on while a better one is possible."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _int_at_least("beam_width", self.beam_width, 1)
        _int_at_least("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature)
        if self.temperature != 0:
            raise ValueError(f"beam search is deterministic: temperature must be 0, got {self.temperature}")
        _number("length_penalty", self.length_penalty)
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got {self.length_penalty}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}')
