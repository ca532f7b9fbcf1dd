"""GET /v1/requests: every unfinished request with its state, timings and counts, behind the API
key; the request's final state is on its metrics (prefill and decode time histograms)."""
from __future__ import annotations

import threading
import time

import httpx
from server_process import API_KEY, MAIN


def test_live_requests_are_listed_with_their_state(server, http):
    body = {"model": MAIN, "prompt": "def fibonacci(n):", "max_tokens": 600, "ignore_eos": True, "stream": True, "n": 2}
    first_chunk = threading.Event()

    def stream():
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    first_chunk.set()

    worker = threading.Thread(target=stream)
    worker.start()
    assert first_chunk.wait(60)
    listed = http.get("/v1/requests").json()["data"]
    (row,) = [r for r in listed if r["model"] == MAIN]
    assert row["status"] in ("prefilling", "decoding") and row["num_samples"] == 2 and row["num_preemptions"] == 0
    assert row["arrival_time"] <= row["first_scheduled_time"] and row["queue_time_s"] >= 0 and row["num_prompt_tokens"] > 0
    assert httpx.get(f"{server.url}/v1/requests").status_code == 401
    worker.join(120)
    deadline = time.monotonic() + 10
    while http.get("/v1/requests").json()["data"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/v1/requests").json()["data"] == []
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "pagedllm_request_prefill_time_seconds_count" in metrics and "pagedllm_request_decode_time_seconds_count" in metrics
