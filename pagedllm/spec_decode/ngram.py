"""N-gram (prompt lookup) proposals: no draft model, just the sequence's own history.

Code, quoted text and structured output repeat themselves; when the last n tokens occurred
earlier in the sequence, the tokens that followed them then are a cheap guess at what follows
now. The longest n-gram (from prompt_lookup_max down to prompt_lookup_min) wins, and among its
earlier occurrences the most recent one, which tends to share the most local context.

The search runs once per decode per step, so it is a byte search (`bytes.rfind`, in C) over the
history packed as 8-byte integers, keeping only matches that start on a token boundary, rather
than a comparison of every window in numpy, which cost ~0.1 ms a step on a 300-token history.
"""
from __future__ import annotations

from array import array

_WIDTH = array("q").itemsize


def propose_ngram(tokens: list[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest
    suffix n-gram of `tokens`; [] if no n-gram of length >= min_n recurs."""
    if num_tokens <= 0 or len(tokens) < min_n + 1:
        return []
    packed = array("q", tokens).tobytes()
    end = (len(tokens) - 1) * _WIDTH  # an occurrence must end before the last token
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        start = _last_occurrence(packed, packed[-n * _WIDTH :], end)
        if start >= 0:
            return tokens[start + n : start + n + num_tokens]
    return []


def _last_occurrence(packed: bytes, needle: bytes, end: int) -> int:
    """Token index of the latest occurrence of `needle` within packed[:end], or -1."""
    position = packed.rfind(needle, 0, end)
    while position > 0 and position % _WIDTH:  # a match across token boundaries: look further left
        position = packed.rfind(needle, 0, position + len(needle) - 1)
    return position // _WIDTH if position >= 0 else -1
