"""Incremental detokenization and stop strings.

Decoding each new token alone loses leading spaces (SentencePiece) and splits multi-byte
characters (byte-level BPE), so each step decodes a short window that starts a few tokens back
and emits only the text that window adds — holding back while it ends in an incomplete
character. Stop strings are searched only where the new text could complete one, and text that
could still turn into a stop string is held back from unfinished outputs, so a stop string
never reaches a client, not even for a moment while streaming.
"""
from __future__ import annotations

from typing import Callable

import tokenizers

from pagedllm.engine.sequence import Sequence

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for spacing


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = _direct_decode(tokenizer)

    def start(self, seq: Sequence) -> None:
        seq.detok_read_offset = seq.num_prompt_tokens
        seq.detok_prefix_offset = max(0, seq.num_prompt_tokens - _CONTEXT_TOKENS)

    def decode_new(self, seq: Sequence, flush: bool = False) -> str:
        """The text the latest token adds (possibly empty until a character completes).

        `flush` emits whatever is pending even if it ends in an incomplete character, for the
        end of a sequence."""
        if self.tokenizer is None:
            return ""
        if seq.detok_read_offset == 0:  # first output token of this sample (prompts are never empty)
            self.start(seq)
        skip = seq.request.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self._decode(ids[seq.detok_prefix_offset : seq.detok_read_offset], skip)
        full = self._decode(ids[seq.detok_prefix_offset :], skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not flush):
            return ""
        seq.detok_prefix_offset = seq.detok_read_offset
        seq.detok_read_offset = len(ids)
        return full[len(prefix) :]

    def decode_token(self, token_id: int) -> str:
        return self._decode([token_id], False)


def _direct_decode(tokenizer) -> Callable[[list[int], bool], str]:
    """decode(ids, skip_special_tokens): the Rust tokenizer's own when transformers' would return
    exactly its text (a fast tokenizer that does not clean up tokenization spaces), else
    transformers'. Why: every token is decoded twice (the window with and without it), and
    transformers' wrapper costs several times the decode itself on these short windows — per
    token, as much as a small model's whole verification row."""
    if tokenizer is None:  # a model folder without one: token ids in, token ids out, no text
        return lambda ids, skip: ""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that the last `num_new_chars` characters complete: (index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
