"""/v1/completions through the official openai client against a real server."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_process import MAIN
from tiny_models import load_reference
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams

PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def tokenizer(serve_models):
    return AutoTokenizer.from_pretrained(serve_models / "tiny-llama")


def test_completion_shape_and_exact_usage(client, tokenizer):
    out = client.completions.create(model=MAIN, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MAIN
    assert abs(out.created - __import__("time").time()) < 60
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_greedy_text_equals_llm_generate(client, serve_models):
    prompts = ["import os\nimport sys\n\n", "class Parser:\n    def __init__(self", "x = [i * i for i"]
    served = [client.completions.create(model=MAIN, prompt=p, max_tokens=24, temperature=0).choices[0] for p in prompts]
    llm = LLM(str(serve_models / "tiny-llama"), max_model_len=2048, num_kv_blocks=256)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [c.text for c in served] == [o.outputs[0].text for o in offline]
    assert [c.finish_reason for c in served] == [o.outputs[0].finish_reason for o in offline]


def test_seeded_sampling_is_reproducible_and_n_samples_differ(client):
    kwargs = dict(model=MAIN, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    assert 2 <= first.usage.completion_tokens <= 32


def test_best_of_returns_the_n_most_likely(client):
    out = client.completions.create(model=MAIN, prompt=PROMPT, max_tokens=8, n=2, best_of=4, seed=7, logprobs=0)
    assert len(out.choices) == 2
    sums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert sums[0] >= sums[1] - 1e-4


def test_list_of_prompts_and_token_ids(client, tokenizer):
    ids = tokenizer.encode("while True:")
    out = client.completions.create(model=MAIN, prompt=[ids, tokenizer.encode("for x in")], max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == len(ids) + len(tokenizer.encode("for x in"))
    by_text = client.completions.create(model=MAIN, prompt=["while True:", "for x in"], max_tokens=3, temperature=0)
    assert [c.text for c in by_text.choices] == [out.choices[0].text, out.choices[2].text]


def _ascii_stop(text: str) -> str:
    for i in range(2, len(text) - 2):
        piece = text[i : i + 2]
        if piece.isascii() and piece.strip() and piece.isprintable():
            return piece
    pytest.skip(f"no ascii piece in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    full = client.completions.create(model=MAIN, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = _ascii_stop(full)
    kwargs = dict(model=MAIN, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == full[: full.index(stop)]
    assert finish == "stop"


def test_streaming_matches_non_streaming_with_usage(client):
    kwargs = dict(model=MAIN, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    body = chunks[:-1]
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_sse_framing(server, auth):
    body = {"model": MAIN, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=auth, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[6:])["object"] == "text_completion"
    assert "usage" not in json.loads(events[0][6:])


def test_logprobs_shape(client):
    out = client.completions.create(model=MAIN, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0
    for i in range(5):
        assert lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4  # top-3 plus the chosen, fewer if texts collide
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the top one


def test_echo_logprobs_for_lm_eval_loglikelihood(client, tokenizer, serve_models):
    """lm-evaluation-harness: token-id prompt, echo, logprobs=1, max_tokens=1, temperature 0."""
    ids = tokenizer.encode("def add(a, b):\n    return a + b")
    out = client.completions.create(model=MAIN, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[: len(ids)]) == tokenizer.decode(ids)
    assert choice.text.startswith(tokenizer.decode(ids))
    # the prompt logprobs are the model's: compare with transformers' forward pass
    model = load_reference(serve_models / "tiny-llama")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [float(logits[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=2e-3)
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and max(top.values()) >= logprob - 1e-6
    assert out.usage.completion_tokens == 1


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, tokenizer):
    out = client.completions.create(model=MAIN, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"


def test_echo_streaming(client):
    chunks = list(client.completions.create(model=MAIN, prompt=PROMPT, max_tokens=4, echo=True, stream=True, temperature=0))
    text = "".join(c.choices[0].text for c in chunks)
    whole = client.completions.create(model=MAIN, prompt=PROMPT, max_tokens=4, echo=True, temperature=0).choices[0].text
    assert text == whole and text.startswith(PROMPT)


def test_sampling_extensions_accepted(client):
    out = client.completions.create(
        model=MAIN, prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, seed=3, user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 12, "ignore_eos": True,
                    "priority": 1, "stop_token_ids": [1]},
    )
    assert out.usage.completion_tokens == 12
