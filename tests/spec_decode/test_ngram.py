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


def _reference(tokens: list[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """The definition, written out: the latest earlier start of the longest recurring suffix."""
    if num_tokens <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + num_tokens]
    return []


def test_proposals_match_the_definition_on_random_histories():
    """Small vocabularies make many partial and overlapping matches; large ids make byte
    patterns that match across token boundaries (e.g. 256 = 0x0100), which must not count."""
    import random

    rng = random.Random(0)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 300, 70000])
        tokens = [rng.randrange(vocab) * rng.choice([1, 256, 65536]) for _ in range(rng.randrange(1, 40))]
        args = (rng.randrange(0, 5), rng.randrange(1, 6), rng.randrange(1, 3))
        assert propose_ngram(tokens, *args) == _reference(tokens, *args), (tokens, args)
    boundary = [1, 0, 0, 0, 0, 0, 0, 0, 1]  # bytes of 1 then 0 ... : a misaligned byte match exists
    assert propose_ngram(boundary + [256], 2, max_n=1, min_n=1) == _reference(boundary + [256], 2, 1, 1)
