"""Model management on a real server: list, load on demand, unload (also with requests in
flight, which end with finish_reason "abort"), and routing by "model"."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest
from server_process import API_KEY, LONG, MAIN, MAIN_MAX_LEN


def wait_ready(http, name: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        card = http.get(f"/v1/models/{name}").json()
        if card.get("status") == "ready":
            return card
        assert card.get("status") == "loading", card
        assert time.monotonic() < deadline, f"{name} still loading"
        time.sleep(0.1)


def test_list_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MAIN]
    assert models[0].object == "model" and models[0].owned_by == "pagedllm"
    assert client.models.retrieve(MAIN).id == MAIN


def test_load_route_and_unload_second_model(client, http):
    name = "tiny-qwen2"
    response = http.get(f"/v1/models/{name}")
    assert response.status_code == 404 and "POST /v1/models/tiny-qwen2/load" in response.json()["error"]["message"]
    response = http.post(f"/v1/models/{name}/load")
    assert response.status_code in (200, 202) and response.json()["status"] in ("loading", "ready")
    card = wait_ready(http, name)
    assert card["max_model_len"] == MAIN_MAX_LEN  # the server's --max-model-len applies to every model
    assert http.post(f"/v1/models/{name}/load").json() == {"status": "ready"}
    assert sorted(m.id for m in client.models.list().data) == sorted([MAIN, name])
    out = client.completions.create(model=name, prompt="def f(x):", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert out.model == name and out.usage.completion_tokens == 4
    assert http.delete(f"/v1/models/{name}").json() == {"status": "unloaded"}
    assert [m.id for m in client.models.list().data] == [MAIN]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=name, prompt="x", max_tokens=1)
    assert client.completions.create(model=MAIN, prompt="x", max_tokens=1).choices


def test_load_wait_then_unload_with_requests_in_flight(server, http):
    name = "tiny-llama"  # the main model's folder again, as a second engine with its own KV budget
    assert http.post(f"/v1/models/{name}/load", params={"wait": "true"}).json() == {"status": "ready"}

    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        first_chunk = asyncio.Event()
        started = 0

        async def stream():
            nonlocal started
            chunks = []
            response = await aclient.completions.create(
                model=name, prompt="import", max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
            )
            async for chunk in response:
                chunks.append(chunk)
                if len(chunks) == 1:
                    started += 1
                    if started == 2:
                        first_chunk.set()
            return chunks

        async def whole():
            return await aclient.completions.create(model=name, prompt="while", max_tokens=LONG, extra_body={"ignore_eos": True})

        tasks = [asyncio.create_task(stream()), asyncio.create_task(stream()), asyncio.create_task(whole())]
        await asyncio.wait_for(first_chunk.wait(), 30)
        unloaded = await asyncio.to_thread(http.delete, f"/v1/models/{name}")
        results = await asyncio.gather(*tasks)
        await aclient.close()
        return unloaded, results

    unloaded, (stream_a, stream_b, whole) = asyncio.run(scenario())
    assert unloaded.json() == {"status": "unloaded"}
    for chunks in (stream_a, stream_b):
        assert chunks[-1].choices[0].finish_reason == "abort"
        assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
    assert whole.choices[0].finish_reason == "abort"
    assert whole.usage.completion_tokens < LONG
    assert server.metric("pagedllm_request_success_total", model_name=name, finished_reason="abort") >= 3
    assert http.get("/health").json()["status"] == "healthy"
    assert http.post("/v1/completions", json={"model": MAIN, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_chat_on_a_model_without_template_is_a_clear_400(http):
    assert http.post("/v1/models/no-template/load", params={"wait": "true"}).json() == {"status": "ready"}
    try:
        response = http.post("/v1/chat/completions", json={"model": "no-template", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400
        error = response.json()["error"]
        assert "chat template" in error["message"] and error["param"] == "messages"
        assert http.post("/v1/completions", json={"model": "no-template", "prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        assert http.delete("/v1/models/no-template").status_code == 200


def test_load_and_unload_errors(http):
    for path in ("/v1/models/nope/load", "/v1/models/..%2F..%2Fetc/load", f"/v1/models/{'0' * 300}/load"):
        response = http.post(path)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
    response = http.delete("/v1/models/tiny-qwen2")
    assert response.status_code == 404 and "not loaded" in response.json()["error"]["message"]
    assert http.delete("/v1/models/nope").status_code == 404


def test_a_model_that_fails_to_load_says_why(http):
    response = http.post("/v1/models/broken/load", params={"wait": "true"})
    assert response.status_code == 400
    assert "GPT2LMHeadModel" in response.json()["error"]["message"]
    card = http.get("/v1/models/broken").json()
    assert card["status"] == "failed" and "GPT2LMHeadModel" in card["error"]
    assert "broken" not in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_a_model_larger_than_memory_is_refused_and_the_server_serves_on(client, http):
    response = http.post("/v1/models/huge/load", params={"wait": "true"})
    assert response.status_code == 400, response.text
    assert "GB for its weights" in response.json()["error"]["message"]
    assert http.get("/v1/models/huge").json()["status"] == "failed"
    assert client.completions.create(model=MAIN, prompt="hi", max_tokens=2).choices[0].text is not None


def test_an_endless_chat_template_is_a_400_at_its_deadline(client, http):
    """The template's loops ran forever (and on after unload) before renders had a deadline."""
    assert http.post("/v1/models/endless-template/load", params={"wait": "true"}).json() == {"status": "ready"}
    start = time.monotonic()
    response = http.post("/v1/chat/completions", json={"model": "endless-template", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "did not finish within" in response.json()["error"]["message"], response.text
    assert time.monotonic() - start < 15
    assert http.get("/health").status_code == 200
    completion = http.post("/v1/completions", json={"model": "endless-template", "prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200, completion.text
    assert http.delete("/v1/models/endless-template").json() == {"status": "unloaded"}
