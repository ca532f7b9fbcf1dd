"""/v1/chat/completions through the official openai client against a real server."""
from __future__ import annotations

import pytest
from server_process import MAIN
from transformers import AutoTokenizer

MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write a function that adds two numbers."},
]


@pytest.fixture(scope="module")
def tokenizer(serve_models):
    return AutoTokenizer.from_pretrained(serve_models / "tiny-llama")


def test_chat_completion_uses_the_template_and_counts_exactly(client, tokenizer):
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MAIN
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert out.usage.completion_tokens == 9


def test_chat_stream_role_first_then_content_then_finish(client):
    kwargs = dict(model=MAIN, messages=MESSAGES, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert content == whole
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 20


def test_chat_n2_seeded_and_max_completion_tokens(client):
    kwargs = dict(model=MAIN, messages=MESSAGES, max_completion_tokens=12, n=2, seed=5, temperature=1.0)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens <= 24


def test_chat_stream_n2_each_choice_finishes_once(client):
    chunks = list(client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=6, n=2, seed=1, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [ch.finish_reason for ch in mine].count(None) == len(mine) - 1


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])  # greedy picks the top token
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content).replace("\ufffd", "") == out.choices[0].message.content.replace("\ufffd", "")


def test_chat_stop_string(client):
    whole = client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=30, temperature=0).choices[0].message.content
    stop = next((whole[i : i + 2] for i in range(2, len(whole) - 2) if whole[i : i + 2].isascii() and whole[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"no ascii piece in {whole!r}")
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=30, temperature=0, stop=stop)
    assert out.choices[0].message.content == whole[: whole.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_text_content_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a function "}, {"type": "text", "text": "that adds."}]}]
    plain = [{"role": "user", "content": "Write a function that adds."}]
    a = client.chat.completions.create(model=MAIN, messages=parts, max_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MAIN, messages=plain, max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
