"""`pagedllm serve --data-parallel-size 2`: two engine replicas behind one server — as processes on this
machine, and as Ray actors on the two-node test cluster (tests/ray_local.py).

Both: concurrent requests get the tokens one engine gives; a prompt sharing its first blocks with an
earlier one goes to the same replica (routed for its prefix, and that replica's prefix cache hits);
/metrics has per-replica series whose sums are the model's. Processes: a replica killed with SIGKILL
while a request streams from it fails that request with a clear `replica_died` error (in-stream), the
other replica serves meanwhile, and the replica is started again.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from server_process import start_server

PROMPTS = ["def parse(args):\n    ", "class Stack:\n", "import os\nimport sys\n", "for i in range(10):\n",
           "# a comment\nx = 1\n", "while True:\n    ", "def main():\n    return", "print('hello"]
SHARED = "def compute(values, weights, bias, scale, offset):\n    total = 0\n    for value, weight in zip(values, weights):\n"
TOKENS = 12


@pytest.fixture(scope="module")
def expected(serve_models) -> dict[str, str]:
    llm = LLM(str(serve_models / "tiny-llama"))
    prompts = [*PROMPTS, SHARED + "        total", SHARED + "        if"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(prompts, outs)}


def complete(client: httpx.Client, prompt: str, max_tokens: int = TOKENS) -> str:
    response = client.post("/v1/completions", json={"model": "dp", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def concurrently(client: httpx.Client, prompts: list[str]) -> dict[str, str]:
    answers: dict[str, str] = {}
    threads = [threading.Thread(target=lambda p=p: answers.__setitem__(p, complete(client, p))) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return answers


def replicas(client: httpx.Client) -> list[dict]:
    return client.get("/health").json()["models"]["dp"]["replicas"]


def check_answers_routing_and_metrics(server, expected: dict[str, str]) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert concurrently(client, PROMPTS) == {p: expected[p] for p in PROMPTS}
        routed = {r: server.metric("pagedllm_router_requests_total", model_name="dp", replica=str(r), reason="load")
                  for r in (0, 1)}
        assert all(routed.values()), routed  # both replicas served
        first = complete(client, SHARED + "        total")
        before = {r: server.metric("pagedllm_replica_prefix_cache_hits_total", model_name="dp", replica=str(r)) for r in (0, 1)}
        second = complete(client, SHARED + "        if")
        assert (first, second) == (expected[SHARED + "        total"], expected[SHARED + "        if"])
        by_prefix = [r for r in (0, 1) if server.metric("pagedllm_router_requests_total", model_name="dp",
                                                          replica=str(r), reason="prefix")]
        assert len(by_prefix) == 1, server.metrics()
        deadline = time.monotonic() + 10  # the replicas' stats arrive every 0.2 s
        while server.metric("pagedllm_replica_prefix_cache_hits_total", model_name="dp", replica=str(by_prefix[0])) <= before[by_prefix[0]]:
            assert time.monotonic() < deadline, ("no prefix-cache hit on the replica routed to", server.metrics())
            time.sleep(0.1)
        time.sleep(0.5)
        for name in ("pagedllm_generation_tokens_total", "pagedllm_prompt_tokens_total"):
            total = server.metric(name, model_name="dp")
            parts = [server.metric(name.replace("pagedllm_", "pagedllm_replica_"), model_name="dp", replica=str(r)) for r in (0, 1)]
            assert total == sum(parts) > 0, (name, total, parts)


def test_two_replica_processes(serve_models, expected, tmp_path):
    server = start_server(["--model", str(serve_models / "tiny-llama"), "--served-model-name", "dp",
                           "--data-parallel-size", "2", "--num-kv-blocks", "256"], tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            pids = [r["pid"] for r in replicas(client)]
            assert len(set(pids)) == 2 and server.proc.pid not in pids
        check_answers_routing_and_metrics(server, expected)
        check_24_chats_keep_both_replicas_busy(server)
        check_a_dead_replica_is_restarted(server, expected)
    finally:
        server.stop()
    log = server.log.read_text()
    assert server.proc.returncode in (0, -15), log[-3000:]


def check_24_chats_keep_both_replicas_busy(server) -> None:
    """24 concurrent chats sharing one system prompt (the router's bound on prefix affinity; issue 44:
    all of them once went to replica 0): both replicas take a share of them."""
    def routed() -> list[float]:
        return [sum(server.metric("pagedllm_router_requests_total", model_name="dp", replica=str(r), reason=why)
                    for why in ("prefix", "load")) for r in (0, 1)]

    # ~80 tokens a chat (prompt + max_tokens): 24 of them stay within the router's token slack (one step's
    # budget, 2,048), so only the bound on outstanding requests spreads them
    system = {"role": "system", "content": "Be brief."}
    before = routed()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        def chat(i: int) -> None:
            body = {"model": "dp", "messages": [system, {"role": "user", "content": f"Q{i}?"}],
                    "max_tokens": 2, "temperature": 0}
            assert client.post("/v1/chat/completions", json=body).status_code == 200

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    shares = [after - b for after, b in zip(routed(), before)]
    assert sum(shares) == 24 and min(shares) >= 6, shares


def check_a_dead_replica_is_restarted(server, expected: dict[str, str]) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        result: dict[str, str] = {}

        def stream() -> None:  # both replicas idle: the least loaded by index, replica 0, takes it
            body = {"model": "dp", "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        result["last"] = chunk["error"]["code"] + ": " + chunk["error"]["message"] if "error" in chunk else "ok"

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 30
        while server.metric("pagedllm_replica_num_requests_running", model_name="dp", replica="0") == 0:
            assert time.monotonic() < deadline, "the long request did not run on replica 0"
            time.sleep(0.05)
        live = client.get("/v1/requests").json()["data"]  # the replicas' live requests, gathered
        assert [r["model"] for r in live] == ["dp"], live
        victim = replicas(client)[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        thread.join(60)
        assert result["last"].startswith("replica_died: replica 0 of model 'dp' died"), result
        assert complete(client, PROMPTS[1]) == expected[PROMPTS[1]]  # replica 1 serves meanwhile
        deadline = time.monotonic() + 60
        while not (replicas(client)[0]["alive"] and replicas(client)[0]["restarts"] == 1):
            assert time.monotonic() < deadline, replicas(client)
            time.sleep(0.2)
        assert replicas(client)[0]["pid"] != victim
        assert server.metric("pagedllm_replica_restarts_total", model_name="dp", replica="0") == 1
        assert concurrently(client, PROMPTS[:4]) == {p: expected[p] for p in PROMPTS[:4]}


def test_two_replica_ray_actors_on_two_nodes(ray_cluster, serve_models, expected, tmp_path):
    server = start_server(["--model", str(serve_models / "tiny-llama"), "--served-model-name", "dp", "--cluster", "ray",
                           "--data-parallel-size", "2", "--num-kv-blocks", "256"], tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            nodes = {r["node_id"] for r in replicas(client)}
            assert len(nodes) == 2 and ray_cluster.head_id in nodes, replicas(client)
        check_answers_routing_and_metrics(server, expected)
    finally:
        server.stop()
    assert server.proc.returncode in (0, -15), server.log.read_text()[-3000:]
