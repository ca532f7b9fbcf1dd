"""`pagedllm serve --num-scheduler-steps 8`: a real server decoding several greedy steps per
engine step streams the text the single-step server gives, token bursts and all, and stops
where it does."""
from __future__ import annotations

import openai
import pytest

from pagedllm.layers import kernels
from server_process import API_KEY, start_server, stream_like_plain

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler: no fused decode step")


@pytest.fixture(scope="module")
def multi_client(serve_models, tmp_path_factory):
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", "tiny-multi", "--api-key", API_KEY,
            "--max-model-len", "1024", "--num-kv-blocks", "256", "--num-scheduler-steps", "8"]
    server = start_server(args, tmp_path_factory.mktemp("multi-step-logs") / "server.log")
    yield openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    server.stop()
    assert "Traceback" not in server.log.read_text()


@pytest.mark.parametrize("stops", [False, True])
def test_a_multi_step_server_streams_what_the_plain_one_answers(multi_client, client, stops):
    # with stops: a stop string met in the middle of the text, so in the middle of a burst
    chunks, plain = stream_like_plain(client, multi_client, "tiny-multi", stops)
    deltas = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(deltas) <= plain.usage.completion_tokens // 4  # tokens came in bursts, not one per step
