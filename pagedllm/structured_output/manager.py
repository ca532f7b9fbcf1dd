"""Grammars compiled by llguidance, one matcher per constrained sequence, and the step's masks.

Why llguidance: measured on the default model's 8,192-token vocabulary (docs/serving.md), it
compiles a JSON schema in about 1 ms and computes a token mask in 40-60 µs, in Rust, for a whole
batch in one call (`fill_next_token_bitmask_par`); outlines-core masks faster (~5 µs) but builds
its index per schema in 25-50 ms, which grows with the schema and lands on the request's latency;
xgrammar pulls in triton, a GPU compiler, on every Linux x86-64 install.

The scheduler owns the matchers (they are sequence state): it asks for the masks of the rows it
schedules for sampling and feeds each accepted token back. Masks are bitmasks (32 tokens per
int32), applied to the logits on the device by the sampler.
"""
from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np

from pagedllm.library_errors import describe
from pagedllm.sampling_params import StructuredOutputsParams


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint. JSON is compact (no optional whitespace), so a
    model cannot spend its tokens on spaces."""
    compact = {"whitespace_flexible": False}
    if params.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(params.json), defaults=compact)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=compact)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.2 s)
        self._executor = llguidance.LLExecutor()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher; ValueError naming the problem for a grammar that does not compile, in a
        few words (llguidance's panics come with a backtrace: library_errors.concise)."""
        try:
            grammar = grammar_text(params)
            problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if problem:
                raise ValueError(f"the constraint does not compile: {problem}")
            matcher = llguidance.LLMatcher(self.tokenizer, grammar)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a Rust panic is a BaseException (pyo3's PanicException)
            raise ValueError(f"structured_outputs: {describe(exc)}") from None
        return matcher

    def bitmasks(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), ceil(vocab / 32)] int32: the tokens each matcher allows next."""
        masks = llg_numpy.allocate_token_bitmask(len(matchers), self.tokenizer.vocab_size)
        llg_numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
        return masks
