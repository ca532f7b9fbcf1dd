"""OpenAI's `logit_bias` and vLLM's `allowed_token_ids` over HTTP: honoured (greedy too), bad
keys, values and ids are 400s naming the field; `max_completion_tokens` wins over `max_tokens`."""
from __future__ import annotations

import pytest
from server_process import MAIN, assert_error

MESSAGES = [{"role": "user", "content": "Say something."}]
IDS = {"logprobs": 0, "return_tokens_as_token_ids": True}  # the chosen tokens' ids, in logprobs


def token_ids(choice) -> list[int]:
    tokens = choice.logprobs.tokens if hasattr(choice.logprobs, "tokens") else [c.token for c in choice.logprobs.content]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def greedy_ids(client, temperature: float = 0, extra_body: dict | None = None, **extra) -> list[int]:
    out = client.completions.create(model=MAIN, prompt="Hello", max_tokens=6, temperature=temperature,
                                    extra_body={"ignore_eos": True, **IDS, **(extra_body or {})}, **extra)
    return token_ids(out.choices[0])


def test_logit_bias_forces_and_bans_tokens(client):
    plain = greedy_ids(client)
    forced = next(t for t in range(300, 400) if t not in plain)
    assert greedy_ids(client, logit_bias={str(forced): 100}) == [forced] * 6
    assert greedy_ids(client, logit_bias={str(plain[0]): -100})[0] != plain[0]


def test_logit_bias_in_chat(client):
    kwargs = dict(model=MAIN, messages=MESSAGES, max_completion_tokens=4, temperature=0, logprobs=True,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    plain = token_ids(client.chat.completions.create(**kwargs).choices[0])
    forced = next(t for t in range(300, 400) if t not in plain)
    biased = client.chat.completions.create(**kwargs, logit_bias={str(forced): 100})
    assert token_ids(biased.choices[0]) == [forced] * 4


def test_allowed_token_ids_restricts_sampling(client):
    allowed = [300, 301, 302]
    for temperature in (0, 1.0):
        ids = greedy_ids(client, temperature=temperature, extra_body={"allowed_token_ids": allowed})
        assert set(ids) <= set(allowed)


def test_max_completion_tokens_wins_over_max_tokens(client):
    out = client.chat.completions.create(model=MAIN, messages=MESSAGES, max_tokens=10, max_completion_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("patch,param,contains", [
    ({"logit_bias": {"one": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-3": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "high"}}, "logit_bias", ""),
    ({"logit_bias": {"1000000": 5}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "300"),
    ({"allowed_token_ids": []}, "allowed_token_ids", ""),
    ({"allowed_token_ids": [5, 1000000]}, "allowed_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", ""),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_400s(http, route, patch, param, contains):
    body = {"model": MAIN, "max_tokens": 2, **patch}
    body.update({"prompt": ["a", "b"]} if route == "/v1/completions" else {"messages": MESSAGES})
    error = assert_error(http.post(route, json=body), 400, None, contains)
    assert error["param"] is not None and error["param"].startswith(param), error
