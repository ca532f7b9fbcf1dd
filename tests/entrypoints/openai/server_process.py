"""A real `pagedllm serve` process on 127.0.0.1 for tests, and checks shared by the test modules.

(Kept out of conftest.py so test modules import it by a unique name.)"""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.serve import ServerProcess, launch

API_KEY = "sk-test-pagedllm"
MAIN = "tiny"  # served name of the main model
MAIN_MAX_LEN = 2048  # --max-model-len of the main server; the model allows 4096
# long enough that a stream still runs when a test closes it, short enough for a KV budget
LONG = 1800


class Server(ServerProcess):
    """The server process plus what tests ask of it."""

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


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    """`pagedllm serve ARGS`, with its job store in a folder of its own next to `log`."""
    os.environ.pop("PAGEDLLM_API_KEY", None)  # only the key a test passes counts
    data_dir = log.parent / f"{log.stem}-data"
    process = launch(["--log-level", "warning", "--data-dir", str(data_dir), *args], log, timeout=120, env=env)
    return Server(process.proc, process.url, process.log)


def assert_error(response: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    assert contains in error["message"], error
    return error


def stream_like_plain(client, streaming_client, model: str, stops: bool) -> tuple[list, object]:
    """Streams a greedy completion from `model` on `streaming_client` and checks it against the
    plain server's (`client`, model "tiny"): the same text, finish reason and token count. With
    `stops`, a stop string met mid-text ends both. Returns (the stream's chunks, the plain answer)."""
    prompt = "def main():\n    "
    plain = client.completions.create(model=MAIN, prompt=prompt, max_tokens=29, temperature=0)
    stop = None
    if stops:
        middle = len(plain.choices[0].text) // 2
        stop = plain.choices[0].text[middle : middle + 2]
        plain = client.completions.create(model=MAIN, prompt=prompt, max_tokens=29, temperature=0, stop=stop)
        assert plain.choices[0].finish_reason == "stop"
    stream = streaming_client.completions.create(model=model, prompt=prompt, max_tokens=29, temperature=0, stop=stop,
                                                 stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == plain.choices[0].text and finish == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    return chunks, plain
