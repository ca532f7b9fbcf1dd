"""`pagedllm serve --speculative-config`: a real server speculating with prompt lookup answers
with the tokens it would give without, and exposes vLLM's spec_decode metrics."""
from __future__ import annotations

import json

import openai
import pytest

from server_process import API_KEY, start_server


@pytest.fixture(scope="module")
def spec_server(serve_models, tmp_path_factory):
    # one request at a time stays below disable_by_batch_size: it speculates
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": 4})
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", "tiny-spec", "--api-key", API_KEY,
            "--max-model-len", "1024", "--num-kv-blocks", "256", "--speculative-config", config]
    server = start_server(args, tmp_path_factory.mktemp("spec-logs") / "server.log")
    yield server
    server.stop()
    assert "Traceback" not in server.log.read_text()


def test_speculating_server_answers_as_the_plain_one(spec_server, server, client):
    prompt = "import os\nimport sys\nimport os\nimport sys\n"
    spec_client = openai.OpenAI(base_url=spec_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    ours = spec_client.completions.create(model="tiny-spec", prompt=prompt, max_tokens=32, temperature=0)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0)
    assert ours.choices[0].text == plain.choices[0].text and ours.usage.completion_tokens == 32
    drafts = spec_server.metric("pagedllm_spec_decode_num_draft_tokens_total", model_name="tiny-spec")
    accepted = spec_server.metric("pagedllm_spec_decode_num_accepted_tokens_total", model_name="tiny-spec")
    assert drafts > 0 and 0 <= accepted <= drafts, (drafts, accepted)
    # an engine that does not speculate exposes no spec_decode samples
    assert server.metric("pagedllm_spec_decode_num_draft_tokens_total", model_name="tiny") == 0.0
    spec_server.wait_idle("tiny-spec")
