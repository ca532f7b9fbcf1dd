"""Schemathesis over the real server's /openapi.json, every route (the training routes included): no
5xx, every status, body, content type and header as the document says, schema-violating requests
refused, the API key enforced. Then the engine still serves and no training job was left running.

`make test` runs a fixed seed at 10 examples per operation (~1,500 cases with the coverage phase);
`make soak` a random seed at 100 (more than 2,000)."""
from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_process import start_server
from soak import SOAK, budget, record

CONFIG = Path(__file__).with_name("schemathesis.toml")
KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def fuzz_server(serve_models, tmp_path_factory):
    """tiny-llama with a short context (so any generation the fuzzer reaches is cheap), a key, one training slot."""
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", "tiny", "--api-key", KEY,
            "--max-model-len", "64", "--max-num-seqs", "8", "--num-kv-blocks", "64", "--train-slots", "1"]
    server = start_server(args, tmp_path_factory.mktemp("logs") / "fuzz.log")
    yield server
    server.stop()


def test_schemathesis_finds_no_5xx_and_no_schema_violation(fuzz_server, tmp_path):
    examples = budget(10, 100)
    seed = [] if SOAK else ["--seed", "1"]
    reports = tmp_path / "reports"
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
               fuzz_server.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}", "--max-examples", str(examples),
               *seed, "--no-color", "--generation-database", "none", "--request-timeout", "60",
               "--report", "json,ndjson", "--report-json-path", str(reports / "run.json"),
               "--report-ndjson-path", str(reports / "events.ndjson")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    summary = json.loads((reports / "run.json").read_text())
    assert proc.returncode == 0 and summary["exit_code"] == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
    assert not summary["failures"] and not summary["errors"], summary
    assert summary["operations"]["tested"] == summary["operations"]["total"] >= 22

    statuses = response_statuses(reports / "events.ndjson")
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    generated = summary["test_cases"]["generated"]
    assert server_errors == 0, statuses
    assert generated >= (2000 if SOAK else 1000) and statuses[200] > 0 and statuses[401] > 0, (generated, statuses)

    http = httpx.Client(base_url=fuzz_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    cancelled = still_serves_and_no_job_left(http)
    log = fuzz_server.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-6000:]
    record("fuzz", {"seed": summary["seed"], "examples_per_operation": examples, "cases": generated,
                    "operations": summary["operations"]["tested"], "responses": sum(statuses.values()),
                    "status_counts": {str(k): v for k, v in sorted(statuses.items())}, "server_errors": server_errors,
                    "jobs_cancelled_after": cancelled, "seconds": round(summary["running_time"], 1)})


def response_statuses(ndjson: Path) -> collections.Counter:
    """Status code of every response the fuzzer received, from its event stream."""
    counts: collections.Counter = collections.Counter()

    def walk(node):
        if isinstance(node, dict):
            response = node.get("response")
            if isinstance(response, dict) and isinstance(response.get("status_code"), int):
                counts[response["status_code"]] += 1
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    with open(ndjson) as events:
        for line in events:
            if '"status_code"' in line:
                walk(json.loads(line))
    return counts


def still_serves_and_no_job_left(http: httpx.Client) -> int:
    """The model answers (loaded again if the fuzzer unloaded it), and no training job runs; the jobs cancelled."""
    if "tiny" not in [m["id"] for m in http.get("/v1/models").json()["data"]]:
        assert http.post("/v1/models/tiny/load", params={"wait": True}).status_code == 200
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "def", "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text
    assert http.get("/health").json()["status"] == "healthy"
    cancelled = 0
    for job in http.get("/v1/training/jobs").json()["data"]:
        if job["status"] in ("PENDING", "RUNNING", "CHECKPOINTING"):
            assert http.delete(f"/v1/training/jobs/{job['job_id']}", params={"grace_seconds": 0}).status_code == 200
            cancelled += 1
    return cancelled
