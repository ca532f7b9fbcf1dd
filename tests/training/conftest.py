"""Session fixtures for the training tests: a stdlib corpus, a tokenizer trained on it, a token cache."""
from __future__ import annotations

import pytest

from pagedllm.training.tokenizer import train_tokenizer

from .helpers import VOCAB, write_corpus


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("training-data")
    corpus = write_corpus(root / "corpus")
    train_tokenizer(str(corpus), VOCAB, root / "tokenizer")
    return {"corpus": corpus, "tokenizer": root / "tokenizer", "cache": root / "cache"}
