"""Every field of OpenAI's and vLLM's request bodies is accepted: honoured where it means something
here, accepted and named once in the log where it cannot, refused (400 naming it) where ignoring it
would give a wrong answer; an unknown top-level field is logged and ignored, as vLLM does (compat.py)."""
from __future__ import annotations

import json

import pytest
from server_process import MAIN, assert_error

MESSAGES = [{"role": "user", "content": "Say something."}]


def stream_events(http, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 6}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6}),
])
def test_continuous_usage_stats_in_every_chunk(http, route, body):
    events = stream_events(http, route, {"model": MAIN, "temperature": 0, "ignore_eos": True, **body,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 6 and usages[-1]["total_tokens"] == usages[-1]["prompt_tokens"] + 6
    assert events[-1]["choices"] == []  # then the usage-only chunk, as include_usage asks


def test_usage_only_at_the_end_without_continuous_stats(http):
    events = stream_events(http, "/v1/completions", {"model": MAIN, "prompt": "Hi", "max_tokens": 4,
                                                      "stream_options": {"include_usage": True}})
    assert all("usage" not in e for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 4


def test_truncate_prompt_tokens_keeps_the_last_tokens(http):
    prompt = list(range(10, 60))
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    truncated = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 12}).json()
    assert truncated["usage"]["prompt_tokens"] == 12
    same = http.post("/v1/completions", json={**body, "prompt": prompt[-12:]}).json()
    assert truncated["choices"][0]["text"] == same["choices"][0]["text"]


def test_return_tokens_as_token_ids(http):
    body = {"model": MAIN, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True}
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in logprobs["tokens"])
    chat = {"model": MAIN, "messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") for c in content)


def test_request_id_names_the_response(http):
    body = {"model": MAIN, "messages": MESSAGES, "max_tokens": 2, "request_id": "abc-123"}
    assert http.post("/v1/chat/completions", json=body).json()["id"] == "chatcmpl-abc-123"


def test_fields_without_meaning_here_are_accepted_and_logged(http, server):
    body = {"model": MAIN, "messages": MESSAGES, "max_tokens": 2, "store": True, "metadata": {"team": "a"},
            "service_tier": "auto", "reasoning_effort": "low", "prompt_cache_key": "k", "verbosity": "low",
            "guided_decoding_backend": "xgrammar", "spaces_between_special_tokens": False,
            "stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True}
    events = stream_events(http, "/v1/chat/completions", body)
    assert events[-1]["usage"]["completion_tokens"] == 2
    log = server.log.read_text()
    for name in ("store", "metadata", "service_tier", "reasoning_effort", "guided_decoding_backend"):
        assert f"request field {name!r} accepted and ignored" in log


@pytest.mark.parametrize("patch,param", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"logits_processors": ["mypkg.Processor"]}, "logits_processors"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, None),  # with add_generation_prompt's default true
])
def test_fields_that_would_mislead_are_400(http, patch, param):
    error = assert_error(http.post("/v1/chat/completions", json={"model": MAIN, "messages": MESSAGES, "max_tokens": 2, **patch}), 400)
    if param is not None:
        assert param in (error["param"] or "") + error["message"], error


def test_template_options_change_the_prompt(http):
    def prompt_tokens(**patch) -> int:
        body = {"model": MAIN, "messages": MESSAGES + [{"role": "assistant", "content": "Well"}], "max_tokens": 1, **patch}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=False) < plain
    assert prompt_tokens(add_generation_prompt=False, continue_final_message=True) < prompt_tokens(add_generation_prompt=False)
    assert prompt_tokens(chat_template_kwargs={"unused_by_this_template": 1}) == plain


def test_deprecated_functions_become_tools(http):
    function = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                                      "required": ["city"], "additionalProperties": False}}
    body = {"model": MAIN, "messages": MESSAGES, "max_tokens": 120, "temperature": 0.5, "seed": 1}
    old = http.post("/v1/chat/completions", json={**body, "functions": [function], "function_call": {"name": "get_weather"}}).json()
    new = http.post("/v1/chat/completions", json={**body, "tools": [{"type": "function", "function": function}],
                                                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).json()
    assert old["usage"] == new["usage"]
    (call,) = old["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MAIN, "messages": MESSAGES, "max_tokens": 2}),
    ("/v1/completions", {"model": MAIN, "prompt": "x", "max_tokens": 2}),
])
def test_unknown_fields_are_logged_and_ignored(server, http, path, body):
    plain = http.post(path, json={**body, "temperature": 0}).json()
    response = http.post(path, json={**body, "temperature": 0, "my_client_extension": {"a": 1}, "max_token": 9})
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == plain["choices"]
    log = server.log.read_text()
    assert "present in the request but ignored: ['max_token', 'my_client_extension']" in log


def test_unknown_fields_inside_a_request_are_still_400(http):
    body = {"model": MAIN, "messages": [{"role": "user", "content": "hi", "colour": "red"}], "max_tokens": 2}
    assert_error(http.post("/v1/chat/completions", json=body), 400, None, "unrecognized")


def test_version_is_open_as_in_vllm(server):
    import importlib.metadata

    import httpx

    response = httpx.get(server.url + "/version", timeout=10)  # no API key, as /health
    assert response.status_code == 200 and response.json() == {"version": importlib.metadata.version("pagedllm")}
