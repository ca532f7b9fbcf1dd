"""Every error is answered with its status and OpenAI's shape: 400, 401, 404, 503, never 500."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_process import API_KEY, LONG, MAIN, MAIN_MAX_LEN, assert_error, start_server


COMPLETION = {"model": MAIN, "prompt": "def", "max_tokens": 2}


@pytest.mark.parametrize(
    "patch, param, contains",
    [
        ({"temperature": -1}, "temperature", ">= 0"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"n": 0}, "n", ">= 1"),
        ({"n": 3, "best_of": 2}, "best_of", "best_of must be >= n"),
        ({"n": 257}, "n", "exceeds max_num_seqs=256"),  # issue 45: more samples than can run at once
        ({"best_of": 257}, "best_of", "exceeds max_num_seqs=256"),
        ({"max_tokens": -1}, "max_tokens", ""),
        ({"max_tokens": 0}, None, "echo"),
        ({"logprobs": 21}, "logprobs", "20"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"seed": 2**70}, "seed", ""),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [1, "a"]}, "prompt", ""),
        ({"prompt": [10**6]}, "prompt", "outside the vocabulary"),
        ({"stream_options": {"include_usage": True, "typo": 1}, "stream": True}, "typo", "unrecognized"),
        ({"logit_bias": {"one": 5}}, "logit_bias", "token ids"),
        ({"stream_options": {"include_usage": True}}, None, "stream"),
    ],
)
def test_invalid_completion_parameters(http, patch, param, contains):
    assert_error(http.post("/v1/completions", json={**COMPLETION, **patch}), 400, param, contains)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_rejected(http, value):
    body = ('{"model": "%s", "prompt": "x", "max_tokens": 2, "repetition_penalty": %s}' % (MAIN, value)).encode()
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, "repetition_penalty")


@pytest.mark.parametrize(
    "body, contains",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "JSON object"),
        (b'"text"', "JSON object"),
    ],
)
def test_malformed_bodies(http, body, contains):
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, None, contains)


def test_prompt_too_long_names_the_limit(http):
    response = http.post("/v1/completions", json={**COMPLETION, "prompt": "x = 1\n" * 3000})
    assert_error(response, 400, "prompt", f"max_model_len is {MAIN_MAX_LEN}")
    response = http.post("/v1/completions", json={**COMPLETION, "prompt": "x", "max_tokens": MAIN_MAX_LEN})
    assert_error(response, 400, "max_tokens", f"maximum context length is {MAIN_MAX_LEN}")


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"messages": "hello"}, "messages"),
        ({"top_logprobs": 3}, None),
        ({"logprobs": True, "top_logprobs": 50}, "logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_invalid_chat_parameters(http, patch, param):
    body = {"model": MAIN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **patch}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_unknown_model_and_route(http, client):
    assert_error(http.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.put("/v1/completions"), 405)
    # Allow names every method served at the path, not only the first route's
    assert http.options("/v1/models/" + MAIN).headers["Allow"] == "GET, DELETE"
    assert http.options("/v1/training/jobs").headers["Allow"] == "GET, POST"


def test_api_key_enforced_but_health_and_metrics_open(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(server.base_url + "/completions", json=COMPLETION, headers=headers)
        assert_error(response, 401)
        assert_error(httpx.get(server.base_url + "/models", headers=headers), 401)
    assert_error(httpx.post(server.base_url + "/completions", content=b"{bad", headers={}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/openapi.json").json()["paths"]["/v1/completions"]


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MAIN, prompt="x", max_tokens=1, temperature=-3)
    assert info.value.body["param"] == "temperature"


# ---- 503: a server whose waiting queue holds one request ----------------------------------
@pytest.fixture(scope="module")
def queue_server(serve_models, tmp_path_factory):
    # The running request must outlast the test's HTTP round trips: with the fused decode step
    # this tiny model streams its 1800 tokens in about a second, so it runs on the modules.
    args = ["--model", str(serve_models / "tiny-llama"), "--max-num-seqs", "1", "--max-waiting-requests", "1", "--num-kv-blocks", "256",
            "--decode-backend", "torch"]
    server = start_server(args, tmp_path_factory.mktemp("logs") / "queue.log")
    yield server
    server.stop()


def test_queue_full_is_503_and_a_waiting_client_that_leaves_is_aborted(queue_server):
    srv = queue_server
    url = srv.base_url + "/completions"
    long = {"prompt": "import", "max_tokens": LONG, "ignore_eos": True}
    with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as running:  # occupies the only slot
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")
        waiting_status = []
        waiter = threading.Thread(target=lambda: waiting_status.append(_post_and_leave(url, long)))
        waiter.start()
        _wait_for(lambda: srv.metric("pagedllm_num_requests_waiting", model_name="tiny-llama") == 1)
        full = httpx.post(url, json={"prompt": "x", "max_tokens": 1})
        error = assert_error(full, 503, None, "full")
        assert error["code"] == "queue_full" and error["type"] == "server_error"
        assert full.headers["Retry-After"] == "1"  # clients back off instead of hammering a full queue
        assert httpx.get(srv.url + "/health").json()["status"] == "degraded"
        waiter.join()
        assert waiting_status == ["left"]
        # the waiting request was aborted while the first one still runs
        _wait_for(lambda: srv.metric("pagedllm_num_requests_waiting", model_name="tiny-llama") == 0)
        assert srv.metric("pagedllm_request_success_total", model_name="tiny-llama", finished_reason="abort") == 1
        assert srv.metric("pagedllm_num_requests_running", model_name="tiny-llama") == 1
    srv.wait_idle("tiny-llama")  # closing the stream aborted the running one too
    assert srv.metric("pagedllm_request_success_total", model_name="tiny-llama", finished_reason="abort") == 2
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def _post_and_leave(url: str, body: dict) -> str:
    try:
        httpx.post(url, json=body, timeout=1.0)
    except httpx.ReadTimeout:
        return "left"
    return "answered"


def _wait_for(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


# ---- a request timeout and a KV pool smaller than the context -----------------------------------
POOL_TOKENS = 64 * 16  # --num-kv-blocks 64 x --block-size 16, below --max-model-len 2048


@pytest.fixture(scope="module")
def limits_server(serve_models, tmp_path_factory):
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", MAIN, "--max-model-len", "2048",
            "--num-kv-blocks", "64", "--block-size", "16", "--request-timeout", "0.5", "--api-key", API_KEY,
            "--protect-metrics", "--decode-backend", "torch"]  # the fused step would finish 1016 tokens within 0.5 s
    server = start_server(args, tmp_path_factory.mktemp("logs") / "limits.log")
    yield server
    server.stop()
    log = server.log.read_text()
    assert "Traceback" not in log, log[-6000:]


def test_request_timeout_is_504_and_frees_the_request(limits_server):
    srv, auth = limits_server, {"Authorization": f"Bearer {API_KEY}"}
    long = {"model": MAIN, "prompt": "import", "max_tokens": POOL_TOKENS - 8, "ignore_eos": True}
    started = time.monotonic()
    error = assert_error(httpx.post(srv.base_url + "/completions", json=long, headers=auth, timeout=30), 504, None, "0.5 s")
    assert error["code"] == "timeout" and time.monotonic() - started < 5
    with httpx.stream("POST", srv.base_url + "/completions", json={**long, "stream": True}, headers=auth, timeout=30) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "timeout" and "choices" in events[0]  # tokens, then the error in-stream
    metrics = httpx.get(srv.url + "/metrics", headers=auth).text
    assert 'pagedllm_request_success_total{finished_reason="abort",model_name="tiny"} 2.0' in metrics
    deadline = time.monotonic() + 10
    while 'pagedllm_kv_cache_usage_perc{model_name="tiny"} 0.0' not in httpx.get(srv.url + "/metrics", headers=auth).text:
        assert time.monotonic() < deadline, "KV blocks not freed after the timeouts"
        time.sleep(0.05)
    quick = httpx.post(srv.base_url + "/completions", json={**long, "max_tokens": 4}, headers=auth, timeout=30)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 4


def test_a_request_that_can_never_fit_the_kv_pool_is_400_at_admission(limits_server):
    srv, auth = limits_server, {"Authorization": f"Bearer {API_KEY}"}
    url = srv.base_url + "/completions"
    too_much = httpx.post(url, json={"model": MAIN, "prompt": "x", "max_tokens": POOL_TOKENS}, headers=auth)
    assert_error(too_much, 400, "max_tokens", f"holds {POOL_TOKENS} tokens in all")
    prompt = [5 + i % 300 for i in range(POOL_TOKENS)]  # under max_model_len, over the pool
    assert_error(httpx.post(url, json={"model": MAIN, "prompt": prompt, "max_tokens": 1}, headers=auth), 400, "prompt",
                 "more than the whole KV cache holds")
    chat = {"model": MAIN, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": POOL_TOKENS}
    assert_error(httpx.post(srv.base_url + "/chat/completions", json=chat, headers=auth), 400, "max_completion_tokens")


def test_protected_metrics_need_the_key(limits_server):
    assert_error(httpx.get(limits_server.url + "/metrics"), 401)
    assert httpx.get(limits_server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(limits_server.url + "/health").status_code == 200
    schema = httpx.get(limits_server.url + "/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert "401" in schema["paths"]["/metrics"]["get"]["responses"]
    assert "401" not in schema["paths"]["/health"]["get"]["responses"]
    assert "422" not in json.dumps(schema["paths"])  # validation errors are 400s, documented as such
