"""N-gram (prompt lookup) proposals: no draft model, just the sequence's own history.

Code, quoted text and structured output repeat themselves; when the last n tokens occurred
earlier in the sequence, the tokens that followed them then are a cheap guess at what follows
now. The longest n-gram (from prompt_lookup_max down to prompt_lookup_min) wins, and among its
earlier occurrences the most recent one, which tends to share the most local context.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest
    suffix n-gram of `tokens`; [] if no n-gram of length >= min_n recurs."""
    if num_tokens <= 0 or len(tokens) < min_n + 1:
        return []
    history = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = sliding_window_view(history[:-1], n)  # every n-gram that starts before the suffix
        matches = np.flatnonzero((windows == history[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + num_tokens]
    return []
