"""The app in-process (TestClient runs its lifespan and engine threads): a server without models,
an engine loop that dies (unhealthy, 503) and recovers by reloading, and fuzzed request bodies
that must never produce a 500 or stop the engine."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_process import assert_error

from pagedllm.entrypoints.openai.app import create_app
from pagedllm.entrypoints.openai.settings import ModelSpec, ServerSettings


@pytest.fixture(scope="module")
def app_client(model_dir):
    folder = model_dir("llama")
    settings = ServerSettings(
        models=[ModelSpec("tiny", str(folder))],
        model_dir=str(folder.parent),
        engine_args={"max_model_len": 64, "max_num_seqs": 8, "num_kv_blocks": 64},
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client


def test_server_without_models(tmp_path):
    with TestClient(create_app(ServerSettings()), raise_server_exceptions=False) as client:
        assert client.get("/v1/models").json() == {"object": "list", "data": []}
        assert_error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}), 404, "model")
        assert_error(client.post("/v1/completions", json={"prompt": "x"}), 400, "model", "model is required")
        assert_error(client.post("/v1/models/tiny/load"), 404, None, "no --model-dir")
        assert client.get("/health").json() == {"status": "healthy", "models": {}}


def test_dead_engine_is_unhealthy_until_reloaded(app_client, monkeypatch):
    served = app_client.app.state.models.get("tiny")

    def broken_step():
        raise RuntimeError("injected engine failure")

    monkeypatch.setattr(served.engine.engine, "step", broken_step)
    error = assert_error(app_client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}), 503, None, "injected")
    assert error["code"] == "engine_dead"
    health = app_client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert "injected" in health.json()["models"]["tiny"]["reason"]
    assert_error(app_client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}), 503)
    assert app_client.delete("/v1/models/tiny").json() == {"status": "unloaded"}
    assert app_client.post("/v1/models/tiny/load", params={"wait": True}).json() == {"status": "ready"}
    assert app_client.get("/health").json()["status"] == "healthy"
    assert app_client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_unloading_releases_the_engine(app_client, model_dir):
    name = model_dir("llama").name  # the same folder, loadable by name from --model-dir
    assert app_client.post(f"/v1/models/{name}/load", params={"wait": True}).json() == {"status": "ready"}
    engine = weakref.ref(app_client.app.state.models.get(name).engine.engine)
    assert app_client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2}).status_code == 200
    assert app_client.delete(f"/v1/models/{name}").json() == {"status": "unloaded"}
    gc.collect()
    assert engine() is None, "the unloaded engine (weights, KV pool) is still referenced"


def test_a_dead_engine_is_released_at_unload(app_client, model_dir):
    """The engine's error (its traceback holds the engine loop's frames) must not keep the engine's
    weights and KV pool alive until some later garbage collection."""
    name = model_dir("llama").name
    assert app_client.post(f"/v1/models/{name}/load", params={"wait": True}).json() == {"status": "ready"}
    engine = app_client.app.state.models.get(name).engine.engine

    def broken_step():
        raise RuntimeError("injected engine failure")

    engine.step = broken_step
    released = weakref.ref(engine)
    del engine
    assert_error(app_client.post("/v1/completions", json={"model": name, "prompt": "x"}), 503, None, "injected")
    gc.disable()  # only what unloading itself releases counts
    try:
        assert app_client.delete(f"/v1/models/{name}").json() == {"status": "unloaded"}
        assert released() is None, "the dead engine (weights, KV pool) outlived its unload"
    finally:
        gc.enable()


# ---- fuzzing: any body, never a 500 --------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
NUMBERS = st.one_of(st.integers(-3, 80), st.floats(-3, 3), st.sampled_from([0, 1, 2**63, -(2**63), 1e300, 1e-300]))
COMMON = {
    "temperature": NUMBERS | JSON, "top_p": NUMBERS, "top_k": NUMBERS, "min_p": NUMBERS, "n": NUMBERS,
    "seed": NUMBERS, "presence_penalty": NUMBERS, "frequency_penalty": NUMBERS, "repetition_penalty": NUMBERS,
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), JSON),
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}) | JSON,
    "ignore_eos": st.booleans(), "min_tokens": NUMBERS, "stop_token_ids": st.lists(NUMBERS, max_size=3) | JSON,
    "priority": NUMBERS, "logit_bias": JSON, "user": JSON,
}
PROMPTS = st.one_of(
    st.text(max_size=40), st.lists(st.integers(-2, 400), max_size=10), st.lists(st.text(max_size=8), max_size=3),
    st.lists(st.lists(st.integers(0, 400), max_size=5), max_size=3), JSON,
)
# now and then one field (the model, an unknown one, ...) replaced by anything
EXTRA = st.dictionaries(st.sampled_from(["model", "prompt", "messages", "max_tokens"]) | st.text(max_size=6), JSON, max_size=1)


def with_extra(bodies):
    return st.tuples(bodies, EXTRA).map(lambda pair: {**pair[0], **pair[1]})


COMPLETION_BODIES = with_extra(st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": PROMPTS, "max_tokens": st.integers(-1, 70)},
    optional={**COMMON, "logprobs": NUMBERS, "echo": st.booleans(), "best_of": NUMBERS, "suffix": JSON},
))
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", ""]), "content": st.text(max_size=20) | JSON}),
    max_size=3,
) | JSON
CHAT_BODIES = with_extra(st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": MESSAGES},
    optional={**COMMON, "max_tokens": NUMBERS, "max_completion_tokens": NUMBERS, "logprobs": st.booleans() | JSON,
              "top_logprobs": NUMBERS, "tools": JSON, "response_format": JSON, "add_generation_prompt": st.booleans()},
))

# in-range values, edges included, so that most requests run through the engine
IN_RANGE = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 500),
    "min_p": st.floats(0, 1), "n": st.integers(1, 3), "seed": st.integers(-(2**63), 2**64 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 5), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3), "priority": st.integers(-5, 5),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
VALID_PROMPTS = st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 383), min_size=1, max_size=20)
VALID_COMPLETIONS = st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": VALID_PROMPTS | st.lists(VALID_PROMPTS, min_size=1, max_size=3), "max_tokens": st.integers(1, 40)},
    optional={**IN_RANGE, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(1, 4)},
)
VALID_CHATS = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}), min_size=1, max_size=3)},
    optional={**IN_RANGE, "max_tokens": st.integers(1, 30), "logprobs": st.booleans(), "add_generation_prompt": st.booleans()},
)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def check(response) -> None:
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = response.text.split("\n\n")
        assert events[-2] == "data: [DONE]", response.text
        assert all('"internal_error"' not in event for event in events), response.text
    else:
        assert response.json()["choices"]


@FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzz_completions(app_client, body):
    check(app_client.post("/v1/completions", content=json.dumps(body)))


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzz_chat(app_client, body):
    check(app_client.post("/v1/chat/completions", content=json.dumps(body)))


@FUZZ
@given(body=VALID_COMPLETIONS)
def test_fuzz_in_range_completions(app_client, body):
    if body.get("stream") and body.get("n", 1) == 1:
        body["stream_options"] = {"include_usage": True}
    check(app_client.post("/v1/completions", json=body))


@FUZZ
@given(body=VALID_CHATS)
def test_fuzz_in_range_chats(app_client, body):
    check(app_client.post("/v1/chat/completions", json=body))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=60) | JSON.map(lambda v: json.dumps(v).encode()), path=st.sampled_from(
    ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/models/tiny/load"]))
def test_fuzz_raw_bodies(app_client, raw, path):
    response = app_client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_error(response, response.status_code)


def test_engine_still_serves_after_fuzzing(app_client):
    assert app_client.get("/health").json()["status"] == "healthy"
    out = app_client.post("/v1/completions", json={"model": "tiny", "prompt": "def", "max_tokens": 3, "ignore_eos": True})
    assert out.json()["usage"]["completion_tokens"] == 3
