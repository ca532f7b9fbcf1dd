"""Fixtures: a stdlib corpus with its tokenizer (the training tests' tiny data), and a real
`pagedllm serve` with 2 training slots, stopped (and any job process of it killed) at the end."""
from __future__ import annotations

import pytest

from training.conftest import tiny_paths  # noqa: F401  (the training tests' stdlib corpus and tokenizer)

from .helpers import JobServer, no_job_processes_left


def serving(tmp_path_factory, name: str, slots: int = 2):
    """A started JobServer; at exit: stopped, and no process of its jobs may be left."""
    root = tmp_path_factory.mktemp(name)
    # the tests' corpora, tokenizers and checkpoint folders live under pytest's base temp folder
    server = JobServer(root / "data", slots, root, allowed=(tmp_path_factory.getbasetemp(),))
    with no_job_processes_left(server.data_dir, server.stop):
        yield server.start()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory, "jobs-server")


@pytest.fixture
def fresh_server(tmp_path_factory):
    """A server of its own, for tests that restart it."""
    yield from serving(tmp_path_factory, "jobs-restart")
