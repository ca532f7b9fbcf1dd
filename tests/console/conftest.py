"""Fixtures for the web console's browser tests: one real `pagedllm serve` per module (a tiny chat
model, a --model-dir with another model and a broken one, a job store with one training slot, an
API key), and Debian's Chromium driven by Playwright with a fresh profile. Screenshots go to
artifacts/console/ (gitignored), or $PAGEDLLM_ARTIFACTS."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from jobs.helpers import no_job_processes_left
from tiny_models import build_model
from training.conftest import tiny_paths  # noqa: F401  (the training tests' stdlib corpus and tokenizer)

from .browser import Browser, CHROMIUM
from .server import API_KEY, ConsoleServer

ARTIFACTS = Path(os.environ.get("PAGEDLLM_ARTIFACTS") or Path(__file__).resolve().parents[2] / "artifacts") / "console"


@pytest.fixture(scope="session")
def console_models(tmp_path_factory) -> Path:
    """A --model-dir: tiny (served at start-up, chat template), tiny-qwen2 (loadable), broken."""
    root = tmp_path_factory.mktemp("console-models")
    build_model(root / "tiny", "llama", max_position_embeddings=4096)
    build_model(root / "tiny-qwen2", "qwen2", seed=1, max_position_embeddings=4096)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    return root


@pytest.fixture(scope="module")
def server(console_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("console-server")
    # the training corpus and tokenizer live under pytest's base temp folder
    args = ["--model", str(console_models / "tiny"), "--model-dir", str(console_models), "--api-key", API_KEY,
            "--num-kv-blocks", "256", "--train-slots", "1", "--allowed-path", str(tmp_path_factory.getbasetemp())]
    srv = ConsoleServer.start(args, root)
    with no_job_processes_left(srv.data_dir, srv.stop):
        yield srv


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium package")
    with Browser() as b:
        yield b


@pytest.fixture
def page(browser, server):
    """A fresh tab on the server's console; page errors (uncaught JS exceptions) fail the test."""
    tab = browser.new_page(server.url)
    yield tab
    errors = tab.page_errors
    tab.close()
    assert not errors, f"uncaught errors in the page: {errors}"
