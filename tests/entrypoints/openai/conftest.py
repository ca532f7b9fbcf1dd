"""Fixtures: tiny model folders, the main `pagedllm serve` process (started once per session),
and the official `openai` client pointed at it."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from server_process import API_KEY, MAIN, MAIN_MAX_LEN, start_server  # noqa: E402
from tiny_models import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def serve_models(tmp_path_factory) -> Path:
    """A --model-dir: tiny-llama (main, chat template), tiny-qwen2, no-template, broken
    (a config.json that is not a model) huge (a config larger than memory) and endless-template. All allow 4096 positions."""
    root = tmp_path_factory.mktemp("serve-models")
    build_model(root / "tiny-llama", "llama", max_position_embeddings=4096)
    build_model(root / "tiny-qwen2", "qwen2", seed=1, max_position_embeddings=4096)
    build_model(root / "no-template", "llama", seed=2, tokenizer=False, max_position_embeddings=4096)
    build_tokenizer(root / "no-template", chat_template=False)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    # a config whose weights (1,000 layers of 16k width, ~13 TB) no machine here holds: refused at
    # load before anything is allocated (issue 39; such a header once drove a server to 20 GB)
    shutil.copytree(root / "tiny-llama", root / "huge")
    config = json.loads((root / "huge" / "config.json").read_text())
    config.update(num_hidden_layers=1000, hidden_size=16384, intermediate_size=65536, num_attention_heads=128,
                  num_key_value_heads=128, head_dim=128)
    (root / "huge" / "config.json").write_text(json.dumps(config))
    # a chat template that would loop 10^10 times: stopped at its render deadline (issue 39)
    shutil.copytree(root / "tiny-llama", root / "endless-template")
    (root / "endless-template" / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    return root


@pytest.fixture(scope="session")
def server(serve_models, tmp_path_factory):
    """The main server: tiny-llama as "tiny", the others loadable, an API key."""
    args = [
        "--model", str(serve_models / "tiny-llama"), "--served-model-name", MAIN,
        "--model-dir", str(serve_models), "--api-key", API_KEY,
        "--max-model-len", str(MAIN_MAX_LEN), "--num-kv-blocks", "1024",
    ]
    srv = start_server(args, tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()
    # uvicorn re-raises the SIGTERM it handled after its graceful shutdown
    assert srv.proc.returncode in (0, -15), f"server exit code {srv.proc.returncode}:\n{srv.log.read_text()[-4000:]}"
    log = srv.log.read_text()
    assert "Traceback" not in log, log[-6000:]


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def http(server, auth):
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as c:
        yield c
