"""`speculative_config`, in vLLM's shape:

    {"model": "path/to/draft", "num_speculative_tokens": 4}                     # a draft model
    {"model": "path/to/draft", "num_speculative_tokens": 4, "draft_vocab_size": 1024}  # scoring its 1024 most frequent tokens
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}     # prompt lookup
    {..., "disable_by_batch_size": 4}   # no proposals while 4 or more sequences run
    {"model": ..., "fused_cycles": false}  # the engine drives every pass even of greedy decodes
    {"model": ..., "quantization": "int8"}  # the draft's weights quantized at load (int8, per channel)
    {"model": ..., "draft_p_min": 0.3}  # greedy proposals stop before one the draft gives less than 0.3
    {"model": ..., "draft_attention_window": 64}  # the draft attends to its last 64 positions only
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.layers.quantization import QUANTIZATION_METHODS

METHODS = ("draft_model", "ngram")
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_vocab_size",
         "disable_by_batch_size", "fused_cycles", "quantization", "draft_p_min", "draft_attention_window"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model's folder (draft_model)
    prompt_lookup_max: int = 4  # longest n-gram matched (ngram)
    prompt_lookup_min: int = 1  # shortest n-gram matched (ngram)
    draft_vocab_size: int | None = None  # the draft scores only its N most frequent tokens (spec_decode/draft_vocab.py)
    # Speculation pauses while this many sequences or more run: a batch already fills the
    # compute that verifying proposals would use, so proposals only cost time there.
    disable_by_batch_size: int | None = None
    # A draft model's greedy cycles (propose, verify, accept) run as one C call when every
    # sequence of a step decodes greedily and both models run the fused decode step
    # (spec_decode/fused_cycles.py); false keeps the engine-driven path for them too.
    fused_cycles: bool = True
    # The draft's weights quantized at load (vLLM's key): its passes read a quarter of the bytes,
    # and only the proposals can change — the target verifies every token.
    quantization: str | None = None
    # A greedy decode's proposals end before the first the draft gives a probability below this
    # (llama.cpp's --draft-p-min): an unsure proposal is seldom accepted, and each costs a draft
    # pass and a verification row. 0 proposes all k. Sampled proposals are not cut (their
    # rejection sampling needs no help, and llama.cpp applies it to greedy drafting only).
    draft_p_min: float = 0.0
    # The draft attends to its last W positions only (a sliding window on every layer): a proposer
    # needs little context, and then its passes read W positions' KV, and a long prompt is
    # mirrored into its pool only as far back as its layers x W positions can reach. Only
    # proposals can change; the target verifies every token.
    draft_attention_window: int | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def parse(cls, value: "dict[str, Any] | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the CLI flag); ValueError naming the bad key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(METHODS)} (or give a draft 'model'), got {method!r}")
        config = cls(
            method=method,
            num_speculative_tokens=value.get("num_speculative_tokens"),
            model=value.get("model"),
            prompt_lookup_max=value.get("prompt_lookup_max", 4),
            prompt_lookup_min=value.get("prompt_lookup_min", 1),
            draft_vocab_size=value.get("draft_vocab_size"),
            disable_by_batch_size=value.get("disable_by_batch_size"),
            fused_cycles=value.get("fused_cycles", True),
            quantization=value.get("quantization"),
            draft_p_min=value.get("draft_p_min", 0.0),
            draft_attention_window=value.get("draft_attention_window"),
        )
        config._validate()
        return config

    def _validate(self) -> None:
        optional = tuple(name for name in ("disable_by_batch_size", "draft_attention_window") if getattr(self, name) is not None)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", *optional):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be <= 16, got {self.num_speculative_tokens}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: the draft_model method needs 'model' (a model folder)")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config: the ngram method takes no 'model'")
        if self.draft_vocab_size is not None:
            if not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool) or self.draft_vocab_size < 1:
                raise ValueError(f"speculative_config: draft_vocab_size must be a positive integer, got {self.draft_vocab_size!r}")
            if self.method != "draft_model":
                raise ValueError("speculative_config: draft_vocab_size applies to a draft model only")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(f"speculative_config: quantization must be one of {list(QUANTIZATION_METHODS)}, "
                                 f"got {self.quantization!r}")
            if self.method != "draft_model":
                raise ValueError("speculative_config: quantization applies to a draft model only")
        p_min = self.draft_p_min
        if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0 <= p_min < 1:
            raise ValueError(f"speculative_config: draft_p_min must be a number in [0, 1), got {p_min!r}")
        if p_min and self.method != "draft_model":
            raise ValueError("speculative_config: draft_p_min applies to a draft model only")
        if self.draft_attention_window is not None and self.method != "draft_model":
            raise ValueError("speculative_config: draft_attention_window applies to a draft model only")
        if not isinstance(self.fused_cycles, bool):
            raise ValueError(f"speculative_config: fused_cycles must be true or false, got {self.fused_cycles!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must be <= prompt_lookup_max")
