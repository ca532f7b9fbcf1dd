"""vLLM's chat-template and tool-calling flags on a real server: --chat-template (a file) replaces
the model's template, --trust-request-chat-template lets a request bring its own (still rendered
in transformers' sandbox), --tool-call-parser pythonic makes forced calls in that format (through
the tool-aware fallback, as the file's template knows no tools), and --no-enable-auto-tool-choice
refuses "auto" as vLLM does without the flag."""
from __future__ import annotations

import json

import openai
import pytest
from server_process import API_KEY, MAIN, assert_error, start_server
from transformers import AutoTokenizer

from pagedllm.entrypoints.tool_parsers.pythonic import PythonicParser
from pagedllm.entrypoints.tool_prompt import fallback_messages

FILE_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>"
REQUEST_TEMPLATE = "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def templated(serve_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("templated")
    (folder / "chat.jinja").write_text(FILE_TEMPLATE)
    server = start_server(["--model", str(serve_models / "tiny-llama"), "--served-model-name", MAIN, "--api-key", API_KEY,
                           "--max-model-len", "1024", "--num-kv-blocks", "256", "--chat-template", str(folder / "chat.jinja"),
                           "--tool-call-parser", "pythonic", "--trust-request-chat-template", "--no-enable-auto-tool-choice"],
                          folder / "server.log")
    yield server, openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    server.stop()
    assert "Traceback" not in server.log.read_text()


@pytest.fixture(scope="module")
def tokenizer(serve_models):
    return AutoTokenizer.from_pretrained(serve_models / "tiny-llama")


def prompt_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_the_servers_template_replaces_the_models(templated, tokenizer):
    _, client = templated
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == prompt_tokens(tokenizer, "<user>Weather in Oslo?</user><assistant>")


def test_a_trusted_request_brings_its_own_template(templated, tokenizer):
    _, client = templated
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=2, temperature=0,
                                         extra_body={"chat_template": REQUEST_TEMPLATE})
    assert out.usage.prompt_tokens == prompt_tokens(tokenizer, "WEATHER IN OSLO?\n")


def test_a_request_template_stays_in_the_sandbox(templated):
    _, client = templated
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=2, extra_body={"chat_template": escape})
    assert caught.value.body["param"] == "chat_template" and "unsafe" in caught.value.body["message"]
    assert client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=2).choices  # still serving


def test_forced_calls_in_the_pythonic_format(templated, tokenizer):
    _, client = templated
    kwargs = dict(model=MAIN, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=1.0, seed=5)
    whole = client.chat.completions.create(**kwargs)
    calls = whole.choices[0].message.tool_calls
    assert calls and whole.choices[0].finish_reason == "tool_calls"
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and len(args["city"]) <= 10 and args["unit"] in ("C", "F")
    system = fallback_messages(MESSAGES, [WEATHER], PythonicParser)[0]["content"]
    assert "[function_name(argument=value" in system
    assert whole.usage.prompt_tokens == prompt_tokens(tokenizer, f"<system>{system}</system><user>Weather in Oslo?</user><assistant>")
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]


def test_auto_needs_the_flag(templated):
    server, _ = templated
    import httpx

    body = {"model": MAIN, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 4}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        assert_error(http.post("/v1/chat/completions", json=body), 400, "tool_choice", "--enable-auto-tool-choice")
        assert http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
