"""A real `pagedllm serve` process on 127.0.0.1 (started once per session), tiny model folders,
and the official `openai` client pointed at it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tiny_models import build_model, build_tokenizer  # noqa: E402

API_KEY = "sk-test-pagedllm"
MAIN = "tiny"  # served name of the main model
MAIN_MAX_LEN = 2048  # --max-model-len of the main server; the model allows 4096
# long enough that a stream still runs when a test closes it, short enough for a KV budget
LONG = 1800


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def serve_models(tmp_path_factory) -> Path:
    """A --model-dir: tiny-llama (main, chat template), tiny-qwen2, no-template, and broken
    (a config.json that is not a model). All allow 4096 positions."""
    root = tmp_path_factory.mktemp("serve-models")
    build_model(root / "tiny-llama", "llama", max_position_embeddings=4096)
    build_model(root / "tiny-qwen2", "qwen2", seed=1, max_position_embeddings=4096)
    build_model(root / "no-template", "llama", seed=2, tokenizer=False, max_position_embeddings=4096)
    build_tokenizer(root / "no-template", chat_template=False)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    return root


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def wait_idle(self, model: str = MAIN, timeout: float = 20) -> None:
        """Until nothing runs or waits and no KV block is in use (fails the test otherwise)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = [
                m.get((name, frozenset({("model_name", model)})), 0.0)
                for name in ("pagedllm_num_requests_running", "pagedllm_num_requests_waiting", "pagedllm_kv_cache_usage_perc")
            ]
            if busy == [0.0, 0.0, 0.0]:
                return
            assert time.monotonic() < deadline, f"server not idle after {timeout}s: running, waiting, kv = {busy}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(args: list[str], log: Path, timeout: float = 120) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.serve", "--port", str(port), "--log-level", "warning", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PAGEDLLM_API_KEY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server did not start in {timeout}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


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
