"""`pagedllm serve --async-scheduling`: a real server whose engine launches each step before the
last one's output is back (on a CPU through the modules, `--decode-backend torch`, as a GPU
runs) streams the text the plain server gives, stops where it stops, and a client that walks
away mid-stream leaves nothing behind."""
from __future__ import annotations

import openai
import pytest

from server_process import API_KEY, start_server, stream_like_plain


@pytest.fixture(scope="module")
def async_server(serve_models, tmp_path_factory):
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", "tiny-async", "--api-key", API_KEY,
            "--max-model-len", "1024", "--num-kv-blocks", "256", "--async-scheduling", "--decode-backend", "torch"]
    server = start_server(args, tmp_path_factory.mktemp("async-logs") / "server.log")
    yield server
    server.stop()
    log = server.log.read_text()
    assert "Traceback" not in log and "async_scheduling is off" not in log


@pytest.fixture(scope="module")
def async_client(async_server):
    return openai.OpenAI(base_url=async_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("stops", [False, True])
def test_an_async_server_streams_what_the_plain_one_answers(async_client, client, stops):
    stream_like_plain(client, async_client, "tiny-async", stops)  # with stops: the step after the stop was launched


def test_a_client_leaving_mid_stream_frees_its_blocks(async_server, async_client):
    stream = async_client.chat.completions.create(model="tiny-async", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=400, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
    for index, _ in enumerate(stream):
        if index == 5:
            break
    stream.close()  # the server aborts the request while a step of it is in flight
    answer = async_client.completions.create(model="tiny-async", prompt="x", max_tokens=3, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    async_server.wait_idle("tiny-async")


def test_placeholders_never_reach_a_stream(async_client, client):
    """While a step is in flight its sequences hold placeholder tokens (-1): a streamed completion
    with logprobs and token ids as text shows only sampled tokens, as the plain server does."""
    asked = dict(model="tiny-async", prompt="def main():\n    ", max_tokens=12, temperature=0, logprobs=2,
                 extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    chunks = list(async_client.completions.create(stream=True, **asked))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    plain = client.completions.create(**{**asked, "model": "tiny"})
    assert tokens == plain.choices[0].logprobs.tokens and len(tokens) == 12
    assert all(t.startswith("token_id:") and int(t.split(":")[1]) >= 0 for t in tokens)


def test_a_server_that_cannot_run_async_says_so_at_start(serve_models, tmp_path):
    """On the fused C decode step there is nothing to overlap: the operator reads why at start,
    whatever the log level."""
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", "tiny-fused", "--api-key", API_KEY,
            "--num-kv-blocks", "64", "--async-scheduling"]
    server = start_server(args, tmp_path / "server.log")
    server.stop()
    assert "model 'tiny-fused': async_scheduling is off: it does not run with the fused C decode step" in server.log.read_text()
