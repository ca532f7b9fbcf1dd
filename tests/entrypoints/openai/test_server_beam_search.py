"""`use_beam_search` on a real server: completions and chat return what `LLM.beam_search` returns
for the same model and prompt (the same search, engine/beam_search.py, driven from the event
loop), with length_penalty and early_stopping; fields the search cannot honour are 400s naming
them."""
from __future__ import annotations

import pytest
from server_process import MAIN, MAIN_MAX_LEN, assert_error

from pagedllm import LLM, BeamSearchParams
from pagedllm.entrypoints.chat_template import render_chat

PROMPTS = ["def parse(args):\n    ", "import os\n"]
MESSAGES = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def llm(serve_models):
    return LLM(str(serve_models / "tiny-llama"), max_model_len=MAIN_MAX_LEN)


def expected(llm, prompt_ids: list[int], n: int, **params) -> list[tuple[str, str, int]]:
    """(text, finish_reason, number of tokens) of LLM.beam_search's n best hypotheses; the text
    without the prompt and a final EOS, as the server returns it."""
    (output,) = llm.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(**params))
    tokenizer = llm.get_tokenizer()
    found = []
    for seq in output.sequences[:n]:
        tokens = seq.tokens[len(prompt_ids):]
        shown = tokens[:-1] if seq.finish_reason == "stop" else tokens
        found.append((tokenizer.decode(shown, skip_special_tokens=True), seq.finish_reason, len(tokens)))
    return found


@pytest.mark.parametrize("width,n,max_tokens,length_penalty,early_stopping", [
    (4, 4, 10, 1.0, False),
    (4, 2, 12, 0.5, "never"),
    (3, 1, 9, 2.0, True),
])
def test_completions_equal_llm_beam_search(client, llm, server, width, n, max_tokens, length_penalty, early_stopping):
    out = client.completions.create(
        model=MAIN, prompt=PROMPTS, n=n, best_of=width, max_tokens=max_tokens,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty, "early_stopping": early_stopping})
    tokenizer = llm.get_tokenizer()
    assert [c.index for c in out.choices] == list(range(len(PROMPTS) * n))
    total = 0
    for p_index, prompt in enumerate(PROMPTS):
        want = expected(llm, tokenizer.encode(prompt), n, beam_width=width, max_tokens=max_tokens,
                        length_penalty=length_penalty, early_stopping=early_stopping)
        got = out.choices[p_index * n : (p_index + 1) * n]
        assert [(c.text, c.finish_reason) for c in got] == [(text, reason) for text, reason, _ in want]
        total += sum(count for _, _, count in want)
    assert out.usage.completion_tokens == total
    server.wait_idle()


def test_a_search_counts_as_one_request_in_the_metrics(client, server):
    """Its rounds are engine requests, one per beam and round: none of them is a finished request
    (issue 44: a width-4 search of 8 tokens once added ~30 to request_success_total)."""
    server.wait_idle()
    metric = lambda: sum(value for (name, labels), value in server.metrics().items()  # noqa: E731
                         if name == "pagedllm_request_success_total" and ("model_name", MAIN) in labels)
    e2e = lambda: server.metric("pagedllm_e2e_request_latency_seconds_count", model_name=MAIN)  # noqa: E731
    before, e2e_before = metric(), e2e()
    out = client.completions.create(model=MAIN, prompt=PROMPTS[0], n=2, best_of=4, max_tokens=8,
                                    extra_body={"use_beam_search": True})
    server.wait_idle()
    assert len(out.choices) == 2 and metric() - before == 2 and e2e() == e2e_before  # one per returned choice


def test_chat_equals_llm_beam_search(client, llm, server):
    tokenizer = llm.get_tokenizer()
    text = render_chat(tokenizer, MESSAGES, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    out = client.chat.completions.create(
        model=MAIN, messages=MESSAGES, n=3, max_completion_tokens=10, temperature=0.7,  # temperature is ignored
        extra_body={"use_beam_search": True, "length_penalty": 1.5})
    want = expected(llm, prompt_ids, 3, beam_width=3, max_tokens=10, length_penalty=1.5)
    assert [(c.message.content, c.finish_reason) for c in out.choices] == [(t, r) for t, r, _ in want]
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == sum(count for _, _, count in want)
    server.wait_idle()


def test_beam_search_with_echo_and_a_token_prompt(http, llm):
    prompt = [5, 17, 42, 9, 120]
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 6, "n": 2, "use_beam_search": True, "echo": True}
    out = http.post("/v1/completions", json=body).json()
    echoed = llm.get_tokenizer().decode(prompt)
    want = expected(llm, prompt, 2, beam_width=2, max_tokens=6)
    assert [c["text"] for c in out["choices"]] == [echoed + text for text, _, _ in want]


@pytest.mark.parametrize("route,patch,param", [
    ("/v1/completions", {"stream": True}, "stream"),
    ("/v1/chat/completions", {"stream": True}, "stream"),
    ("/v1/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"stop": ["\n"]}, "stop"),
    ("/v1/completions", {"stop_token_ids": [3]}, "stop_token_ids"),
    ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ("/v1/completions", {"guided_regex": "[a-z]+"}, "guided_regex"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"n": 11}, "n"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"best_of": 11}, "best_of"),
    ("/v1/completions", {"max_tokens": 0, "echo": True}, "max_tokens"),
    ("/v1/completions", {"early_stopping": "sometimes"}, "early_stopping"),
])
def test_fields_beam_search_cannot_honour_are_400s(http, route, patch, param):
    body = {"model": MAIN, "max_tokens": 4, "use_beam_search": True, "n": 2}
    body.update({"prompt": "Hello"} if route == "/v1/completions" else {"messages": MESSAGES})
    assert_error(http.post(route, json={**body, **patch}), 400, param)


def test_the_event_loop_serves_others_while_a_search_runs(http, server):
    """Rounds are awaited, not run on the loop: a plain request sent alongside a long search
    finishes first."""
    import threading

    done: list[str] = []

    def search():
        body = {"model": MAIN, "prompt": "Hello", "max_tokens": 60, "n": 4, "use_beam_search": True, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
        done.append("search")

    thread = threading.Thread(target=search)
    thread.start()
    response = http.post("/v1/completions", json={"model": MAIN, "prompt": "Hi", "max_tokens": 2})
    done.append("plain")
    thread.join()
    assert response.status_code == 200 and done == ["plain", "search"]
    server.wait_idle()
