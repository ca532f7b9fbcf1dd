"""Schemathesis over the real server's /openapi.json, every route (the training routes included): no
5xx, every status, body, content type and header as the document says, schema-violating requests
refused, the API key enforced. Then the engine still serves and no training job was left running.

`make test` runs a fixed seed at 10 examples per operation (~1,500 cases with the coverage phase);
`make soak` a random seed at 100 (more than 2,000)."""
from __future__ import annotations

import httpx
import pytest
from schemathesis_run import run_schemathesis, still_serves_and_no_job_left
from server_process import start_server
from soak import SOAK, budget, record

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
    summary, statuses = run_schemathesis(fuzz_server.url, KEY, examples, None if SOAK else 1, tmp_path / "reports")
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
