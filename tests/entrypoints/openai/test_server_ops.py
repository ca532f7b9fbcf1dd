"""Metrics, health, client disconnects and concurrency on a real server."""
from __future__ import annotations

import asyncio

import httpx
import openai
from server_process import API_KEY, LONG, MAIN

METRIC_NAMES = [
    "pagedllm_num_requests_running", "pagedllm_num_requests_waiting", "pagedllm_num_requests_swapped",
    "pagedllm_kv_cache_usage_perc", "pagedllm_prefix_cache_queries_total", "pagedllm_prefix_cache_hits_total",
    "pagedllm_num_preemptions_total", "pagedllm_prompt_tokens_total", "pagedllm_generation_tokens_total",
    "pagedllm_time_to_first_token_seconds_count", "pagedllm_inter_token_latency_seconds_count",
    "pagedllm_e2e_request_latency_seconds_count", "pagedllm_request_queue_time_seconds_count",
]


def test_metrics_names_labels_and_counts(server, client):
    before = server.metrics()
    label = frozenset({("model_name", MAIN)})
    out = client.completions.create(model=MAIN, prompt="def metrics(x):", max_tokens=5, extra_body={"ignore_eos": True})
    server.wait_idle()
    after = server.metrics()
    for name in METRIC_NAMES:
        assert (name, label) in after, name
    grew = lambda name: after[(name, label)] - before.get((name, label), 0.0)  # noqa: E731
    assert grew("pagedllm_generation_tokens_total") == 5
    assert grew("pagedllm_prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("pagedllm_time_to_first_token_seconds_count") == 1
    assert grew("pagedllm_inter_token_latency_seconds_count") == 4
    assert grew("pagedllm_e2e_request_latency_seconds_count") == 1
    assert grew("pagedllm_request_queue_time_seconds_count") == 1
    key = ("pagedllm_request_success_total", label | {("finished_reason", "length")})
    assert after[key] - before.get(key, 0.0) == 1
    assert after[("pagedllm_kv_cache_usage_perc", label)] == 0.0
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE pagedllm_kv_cache_usage_perc gauge" in text
    assert "# TYPE pagedllm_time_to_first_token_seconds histogram" in text


def test_prefix_cache_counters(server, client):
    prompt = "def shared_prefix_for_the_cache(alpha, beta, gamma, delta):\n    result = alpha + beta\n" * 2
    client.completions.create(model=MAIN, prompt=prompt, max_tokens=1)
    before = server.metric("pagedllm_prefix_cache_hits_total", model_name=MAIN)
    client.completions.create(model=MAIN, prompt=prompt, max_tokens=1)
    assert server.metric("pagedllm_prefix_cache_hits_total", model_name=MAIN) >= before + 16


def test_health(server):
    body = httpx.get(server.url + "/health").json()
    assert body["status"] == "healthy"
    assert body["models"][MAIN]["status"] == "healthy"


def test_stream_closed_mid_way_is_aborted_and_frees_kv(server, auth):
    server.wait_idle()
    aborted = server.metric("pagedllm_request_success_total", model_name=MAIN, finished_reason="abort")
    body = {"model": MAIN, "prompt": "class Tree:", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=auth, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("pagedllm_kv_cache_usage_perc", model_name=MAIN) > 0
    server.wait_idle(timeout=10)
    assert server.metric("pagedllm_request_success_total", model_name=MAIN, finished_reason="abort") == aborted + 1


def test_openai_client_closing_a_stream_aborts_it(server, client):
    server.wait_idle()
    aborted = server.metric("pagedllm_request_success_total", model_name=MAIN, finished_reason="abort")
    stream = client.chat.completions.create(
        model=MAIN, messages=[{"role": "user", "content": "go"}], max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    server.wait_idle(timeout=10)
    assert server.metric("pagedllm_request_success_total", model_name=MAIN, finished_reason="abort") == aborted + 1


def test_non_streaming_client_that_leaves_is_aborted(server, auth):
    server.wait_idle()
    aborted = server.metric("pagedllm_request_success_total", model_name=MAIN, finished_reason="abort")
    body = {"model": MAIN, "prompt": "class Tree:", "max_tokens": LONG, "ignore_eos": True, "n": 8}
    try:
        # leave long before 8 x 1800 tokens are done (~0.8 s here), and the server notices within
        # its 0.25 s poll (one completion of 1800 tokens took ~0.3 s, too close)
        httpx.post(server.base_url + "/completions", json=body, headers=auth, timeout=httpx.Timeout(5, read=0.1))
    except httpx.ReadTimeout:
        pass
    server.wait_idle(timeout=10)
    # n completions are n engine requests (as in vLLM), each aborted
    assert server.metric("pagedllm_request_success_total", model_name=MAIN, finished_reason="abort") == aborted + body["n"]


def test_32_concurrent_streams_complete_with_exact_usage(server, http):
    prompts = [f"def task_{i}(x):\n    return x * {i}" for i in range(32)]
    lengths = [8 + (i * 7) % 41 for i in range(32)]
    prompt_tokens = [http.post("/tokenize", json={"model": MAIN, "prompt": p}).json()["count"] for p in prompts]

    async def one(aclient, prompt, max_tokens):
        stream = await aclient.completions.create(
            model=MAIN, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0.7, seed=len(prompt),
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        return chunks

    peak_running = [0.0]

    async def watch_batch(done: asyncio.Event):
        async with httpx.AsyncClient() as metrics_client:
            while not done.is_set():
                text = (await metrics_client.get(server.url + "/metrics")).text
                line = next(x for x in text.splitlines() if x.startswith(f'pagedllm_num_requests_running{{model_name="{MAIN}"}}'))
                peak_running[0] = max(peak_running[0], float(line.split()[-1]))
                await asyncio.sleep(0.01)

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_batch(done))
        try:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, lengths)))
        finally:
            done.set()
            await watcher
            await aclient.close()

    results = asyncio.run(run_all())
    for chunks, n_prompt, max_tokens in zip(results, prompt_tokens, lengths):
        usage = chunks[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n_prompt, max_tokens, n_prompt + max_tokens)
        assert chunks[-2].choices[0].finish_reason == "length"
    assert len({chunks[0].id for chunks in results}) == 32
    assert peak_running[0] >= 8, f"requests were not batched together: at most {peak_running[0]} running"
    server.wait_idle()
