"""The crash hunt (issue 28): a real server whose C kernels are built with AddressSanitizer and
UBSan (the ASan runtime preloaded into it: any out-of-bounds access or undefined behaviour in a
kernel ends it with a report), fed the hostile inputs (hostile.py: sizes, ranges, sampling
extremes, lone surrogates; a 50 MB body; many samples of a one-token prompt; prompts of one to four
chunks of the step budget on an idle engine; a model larger than memory and a chat template that
never ends), then Schemathesis over every route
with n and best_of at max_num_seqs and logprobs at 20 in every completion and chat body
(crash_hunt_hooks.py). It passes if no answer is a 5xx, the sanitizer reported nothing, and the
model still serves.

`make test`: the hostile inputs and Schemathesis at 2 examples per operation, fixed seed;
`make soak`: 50 per operation, random seed, its figures kept in soak-results/crash_hunt.json."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from hostile import HOSTILE, SURROGATES, escaped
from schemathesis_run import run_schemathesis, still_serves_and_no_job_left
from server_process import assert_error, start_server
from soak import SOAK, budget, record

from pagedllm.layers import kernels

KEY = "sk-crash-hunt"
MAX_SEQS = 16
BUDGET = 16  # tokens per step: every prompt over it is prefilled in chunks, alone on an idle engine
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "Sanitizer")

pytestmark = pytest.mark.skipif(not kernels.sanitizer_available(),
                                reason="the crash hunt's sanitizer build needs gcc with its ASan runtime")


@pytest.fixture(scope="module")
def hunted(serve_models, tmp_path_factory):
    args = ["--model", str(serve_models / "tiny-llama"), "--served-model-name", "tiny", "--api-key", KEY, "--model-dir", str(serve_models),
            "--max-model-len", "64", "--max-num-seqs", str(MAX_SEQS), "--num-kv-blocks", "256", "--train-slots", "1",
            "--max-num-batched-tokens", str(BUDGET)]
    server = start_server(args, tmp_path_factory.mktemp("logs") / "crash-hunt.log", env=kernels.sanitizer_env())
    yield server
    server.stop()


def sanitizer_reports(server) -> list[str]:
    log = server.log.read_text()
    return [line for line in log.splitlines() if any(report in line for report in REPORTS)]


def test_hostile_inputs_then_schemathesis_at_the_maxima(hunted, tmp_path):
    http = httpx.Client(base_url=hunted.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert "libasan" in open(f"/proc/{hunted.proc.pid}/maps").read(), "the server does not run the sanitizer build"
    try:
        hostile = hostile_pass(http)
    except (httpx.HTTPError, AssertionError) as exc:
        pytest.fail(f"{exc!r}; the server's sanitizer reports: {sanitizer_reports(hunted)[:6]}")
    assert hunted.proc.poll() is None and not sanitizer_reports(hunted), sanitizer_reports(hunted)

    examples = budget(2, 50)
    hooks = {"SCHEMATHESIS_HOOKS": str(Path(__file__).with_name("crash_hunt_hooks.py")),
             "PAGEDLLM_CRASH_HUNT_MAX_SEQS": str(MAX_SEQS)}
    summary, statuses = run_schemathesis(hunted.url, KEY, examples, None if SOAK else 1, tmp_path / "reports", hooks)
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    assert server_errors == 0, statuses
    assert hunted.proc.poll() is None and not sanitizer_reports(hunted), sanitizer_reports(hunted)
    cancelled = still_serves_and_no_job_left(http)
    assert "Traceback" not in hunted.log.read_text(), hunted.log.read_text()[-6000:]
    record("crash_hunt", {"sanitizers": "address,undefined", "hostile_requests": hostile, "seed": summary["seed"],
                          "examples_per_operation": examples, "max_num_seqs": MAX_SEQS, "cases": summary["test_cases"]["generated"],
                          "responses": sum(statuses.values()), "status_counts": {str(k): v for k, v in sorted(statuses.items())},
                          "server_errors": server_errors, "sanitizer_reports": 0, "jobs_cancelled_after": cancelled,
                          "seconds": round(summary["running_time"], 1)})


def hostile_pass(http: httpx.Client) -> int:
    """Every hostile input answered as it should be; how many requests were sent."""
    sent = 0
    for patch, param, contains in HOSTILE:
        assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": "def", "max_tokens": 2, **patch}), 400,
                     param, contains)
        sent += 1
    for patch, param in SURROGATES:
        assert_error(escaped(http, "/v1/completions", {"model": "tiny", "max_tokens": 2, **patch}), 400)
        sent += 1
    for n in (2, 8, 12, MAX_SEQS):  # a one-token prompt's n samples: more logit rows than rows in its fused step
        for body in ({"prompt": [5], "n": n, "max_tokens": 4}, {"prompt": [5], "n": 1, "best_of": n, "max_tokens": 4},
                     {"prompt": [5, 6], "n": n, "max_tokens": 3, "logprobs": 20}):
            response = http.post("/v1/completions", json={"model": "tiny", **body})
            assert response.status_code == 200 and len(response.json()["choices"]) == body["n"], response.text
            sent += 1
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "n": n, "max_tokens": 3, "logprobs": True,
                "top_logprobs": 20}
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200 and len(response.json()["choices"]) == n, response.text
        sent += 1
    for length in (BUDGET - 1, BUDGET, BUDGET + 1, 2 * BUDGET, 3 * BUDGET + 5, 63):  # steps of only prefill chunks
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": list(range(5, 5 + length)), "max_tokens": 1})
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length", response.text
        sent += 1
    # hostile model files: weights larger than memory, a chat template that never ends
    assert_error(http.post("/v1/models/huge/load", params={"wait": "true"}), 400)
    assert http.post("/v1/models/endless-template/load", params={"wait": "true"}).json() == {"status": "ready"}
    endless = {"model": "endless-template", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(http.post("/v1/chat/completions", json=endless), 400)
    assert http.delete("/v1/models/endless-template").json() == {"status": "unloaded"}
    sent += 4
    huge = json.dumps({"model": "tiny", "prompt": "x" * (50 << 20)}).encode()
    assert_error(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}), 413)
    assert_error(http.post("/v1/training/jobs", json={"job_name": "j" * 10_000, "data_config": {}}), 400, "job_name")
    return sent + 2
