"""Prompt-lookup proposals."""
from __future__ import annotations

from pagedllm.spec_decode.ngram import propose_ngram


def test_the_longest_recurring_suffix_proposes_what_followed_it():
    assert propose_ngram([1, 2, 3, 4, 9, 2, 3], 2, max_n=4, min_n=1) == [4, 9]
    assert propose_ngram([7, 1, 2, 5, 1, 2, 6, 1, 2], 3, max_n=2, min_n=1) == [6, 1, 2]  # latest occurrence


def test_nothing_to_propose():
    assert propose_ngram([1, 2, 3], 3, max_n=4, min_n=1) == []
    assert propose_ngram([1, 2, 1], 3, max_n=4, min_n=2) == []  # only a 1-gram recurs
    assert propose_ngram([1, 2, 1, 2], 0, max_n=4, min_n=1) == []
