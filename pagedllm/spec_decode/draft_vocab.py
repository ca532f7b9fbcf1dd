"""A draft model's reduced vocabulary: the tokens of its training corpus, most frequent first.

A small draft model spends most of each proposal step in its LM head (vocabulary x hidden
weights, often several times the rest of the model), yet almost all the tokens it proposes come
from a small part of the vocabulary. With `draft_vocab_size=N` the draft scores only the N most
frequent tokens of its training corpus (frequency-ranked speculative sampling, as in FR-Spec and
EAGLE-3's draft vocabulary). Verification is unchanged: the draft's q is zero outside the subset,
which the rejection rule handles exactly, so outputs keep the target's distribution; a token
outside the subset is simply never proposed.

The ranking is stored with the model as `draft_vocab.json`; the trainer writes it when it
exports a model, from the token counts of the training split.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FILE = "draft_vocab.json"


def rank_tokens(tokens: np.ndarray, vocab_size: int) -> list[int]:
    """Every token id, most frequent in `tokens` first (ties by id)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return np.lexsort((np.arange(vocab_size), -counts)).tolist()


def write(folder: str | Path, ranked: list[int], num_tokens: int) -> Path:
    path = Path(folder) / FILE
    path.write_text(json.dumps({"num_tokens_counted": int(num_tokens), "token_ids_by_frequency": ranked}) + "\n")
    return path


def read(folder: str | Path, vocab_size: int) -> list[int]:
    """The ranking stored with a model; ValueError when it is missing or not a ranking of the vocabulary."""
    path = Path(folder) / FILE
    if not path.is_file():
        raise ValueError(f"speculative_config: draft_vocab_size needs {path} (written by the trainer's export)")
    try:
        ranked = json.loads(path.read_text())["token_ids_by_frequency"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a draft vocabulary ranking: {exc}") from exc
    if sorted(ranked) != list(range(vocab_size)):
        raise ValueError(f"{path} does not rank the {vocab_size} tokens of the vocabulary")
    return ranked
