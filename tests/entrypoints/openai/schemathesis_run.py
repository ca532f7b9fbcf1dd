"""Running Schemathesis against a real server and reading what it saw: shared by the schema fuzz
(test_server_schema_fuzz.py) and the crash hunt (test_server_crash_hunt.py)."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

CONFIG = Path(__file__).with_name("schemathesis.toml")


def run_schemathesis(url: str, key: str, examples: int, seed: int | None, reports: Path,
                     env: dict[str, str] | None = None) -> tuple[dict, collections.Counter]:
    """Every operation of the server's /openapi.json with all configured checks (`env`: e.g. hooks);
    asserts the run found no failure and tested every operation; its summary and response statuses."""
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
               url + "/openapi.json", "-H", f"Authorization: Bearer {key}", "--max-examples", str(examples),
               *(["--seed", str(seed)] if seed is not None else []), "--no-color", "--generation-database", "none",
               "--request-timeout", "60", "--report", "json,ndjson", "--report-json-path", str(reports / "run.json"),
               "--report-ndjson-path", str(reports / "events.ndjson")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})
    summary = json.loads((reports / "run.json").read_text())
    assert proc.returncode == 0 and summary["exit_code"] == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
    assert not summary["failures"] and not summary["errors"], summary
    assert summary["operations"]["tested"] == summary["operations"]["total"] >= 22
    return summary, response_statuses(reports / "events.ndjson")


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
