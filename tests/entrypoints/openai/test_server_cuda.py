"""The OpenAI server on a CUDA device answers a completion and a streamed chat
(`pytest -m cuda`; skipped where there is no GPU)."""
from __future__ import annotations

import openai
import pytest
import torch

from server_process import API_KEY, start_server

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.fixture(scope="module")
def cuda_server(serve_models, tmp_path_factory):
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", "tiny-cuda", "--api-key", API_KEY,
            "--device", "cuda", "--max-model-len", "1024", "--num-kv-blocks", "256"]
    server = start_server(args, tmp_path_factory.mktemp("cuda-logs") / "server.log")
    yield server
    server.stop()
    assert "Traceback" not in server.log.read_text()


def test_completion_and_streamed_chat_on_cuda(cuda_server):
    client = openai.OpenAI(base_url=cuda_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    completion = client.completions.create(model="tiny-cuda", prompt="def parse(args):", max_tokens=8, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny-cuda", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0
