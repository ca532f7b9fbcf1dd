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


@pytest.fixture(scope="session")
def ep_cp_runs(tiny_paths, tmp_path_factory) -> dict:
    """One 4-rank launch for expert and context parallelism (test_expert_parallel.py,
    test_context_parallel.py), and the single-process runs they must equal."""
    from .ep_cp_runs import run_all

    return run_all(tiny_paths, tmp_path_factory.mktemp("ep-cp"))
