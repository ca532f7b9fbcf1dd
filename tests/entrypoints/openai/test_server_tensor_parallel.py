"""`pagedllm serve --tensor-parallel-size 2`: answers as one process does, and its worker
processes never outlive it (not even a SIGKILL of the server)."""
from __future__ import annotations

import signal
import time

import openai
import psutil

from pagedllm import LLM, SamplingParams
from server_process import start_server

PROMPT = "def parse(args):\n    "


def test_tensor_parallel_server_answers_and_its_workers_die_with_it(serve_models, tmp_path):
    folder = serve_models / "tiny-llama"
    expected = LLM(str(folder)).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    server = start_server(["--model", str(folder), "--served-model-name", "tp", "--tensor-parallel-size", "2"],
                          tmp_path / "server.log")
    try:
        workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        assert workers, "the rank-1 worker process should be the server's child"
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        answer = client.completions.create(model="tp", prompt=PROMPT, max_tokens=12, temperature=0)
        assert answer.choices[0].text == expected.outputs[0].text
        stream = client.chat.completions.create(model="tp", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True)
        assert sum(1 for _ in stream) > 1
    finally:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    deadline = time.monotonic() + 10
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
        assert time.monotonic() < deadline, "tensor-parallel workers outlived their server"
        time.sleep(0.2)
