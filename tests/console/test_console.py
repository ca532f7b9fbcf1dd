"""The web console in a real browser against a real server with an API key: the key dialog, a
streamed chat reply equal to the API's own greedy answer, metrics that move with the requests the
test sends, models loaded and unloaded, and a training job submitted as TOML whose loss curve grows
until it completes (plus one submitted from the form and cancelled). Screenshots of each step go to
the artifacts folder."""
from __future__ import annotations

import contextlib
import http.client
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs.helpers import job_body, to_toml

from .server import API_KEY

MODEL = "tiny"
# the tiny model's greedy chat reply is a few hundred tokens (a second or so): many chunks
REPLY = 1000
LONG = 4000  # tokens: a few seconds of decoding for the tiny model (4096 positions, 256 KV blocks of 16)


def wait_idle(server, timeout: float = 20) -> None:
    """Until the model runs nothing and holds no KV block."""
    deadline = time.monotonic() + timeout
    while (stats := server.stats(MODEL))["num_running"] or stats["kv_blocks_used"]:
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {stats}"
        time.sleep(0.05)


def raw_get(url: str, path: str) -> int:
    """GET with the path sent as written (httpx and browsers remove dot segments first)."""
    connection = http.client.HTTPConnection(httpx.URL(url).host, httpx.URL(url).port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def enter_key(page, key: str = API_KEY) -> None:
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", key)
    page.click("#key-save")


def signed_in(page) -> None:
    """Past the key dialog, with the start-up model in the chat picker."""
    enter_key(page)
    page.wait_for_selector("#key-dialog:not([open])", state="attached")
    page.wait_for_function("document.querySelector('#chat-model').value === 'tiny'")


def chart_count(page, chart: str, series: str) -> int:
    """Points drawn on one line of a chart (0 before the chart has any)."""
    return page.evaluate(COUNT_JS, [chart, series])


COUNT_JS = "([chart, series]) => Number(document.querySelector(`#${chart} g[data-series='${series}']`)?.dataset.count ?? 0)"


def wait_count(page, chart: str, series: str, predicate: str, timeout: float = 30_000) -> None:
    """Until the count of points satisfies `predicate` (JS, of n), e.g. "n >= 2"."""
    page.wait_for_function(f"([chart, series]) => {{ const n = ({COUNT_JS})([chart, series]); return {predicate}; }}",
                           arg=[chart, series], timeout=timeout)


def total(page, label: str) -> str:
    return page.inner_text(f"#metrics-totals [data-total='{label}'] b")


@contextlib.contextmanager
def long_stream(server):
    """A LONG-token streaming completion: the body runs once its first chunk has arrived, then the
    rest is read to the end."""
    with httpx.Client(base_url=server.url, headers=server.http.headers, timeout=60) as client:
        stream = client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True})
        with stream as response:
            lines = response.iter_lines()
            next(lines)
            yield
            for _ in lines:
                pass


def test_page_and_assets_are_open_and_the_api_is_not(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '<script type="module" src="/console/static/js/main.js">' in page.text
    script = httpx.get(server.url + "/console/static/js/main.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert script.headers["cache-control"] == "no-cache" and script.headers["etag"]  # revalidated, then 304
    for path in ("/console/api/stats", "/console/api/models", "/v1/models", "/v1/training/jobs"):
        assert httpx.get(server.url + path).status_code == 401, path
        assert server.http.get(path).status_code == 200, path
    # the open asset prefix does not open what a path climbs to from it
    for path in ("/console/static/../api/stats", "/console/static/%2e%2e/api/stats"):
        assert raw_get(server.url, path) == 401, path
    assert httpx.get(server.url + "/console/static/nope.js").status_code == 404


def test_the_page_asks_for_the_key_and_refuses_a_wrong_one(page, server, artifacts):
    p = page.page
    enter_key(p, "sk-wrong")
    p.wait_for_selector("#key-error:not([hidden])")
    assert "refused" in p.inner_text("#key-error")
    p.screenshot(path=artifacts / "key-dialog.png")
    enter_key(p)
    p.wait_for_selector("#key-dialog:not([open])", state="attached")
    p.wait_for_function("document.querySelector('#chat-model').value === 'tiny'")
    # the page holds the key; a call without it is still refused by the server
    assert p.evaluate("fetch('/v1/models').then(r => r.status)") == 401
    assert p.evaluate(f"fetch('/v1/models', {{headers: {{Authorization: 'Bearer {API_KEY}'}}}}).then(r => r.status)") == 200


def test_chat_streams_the_greedy_reply(page, server, artifacts):
    p = page.page
    signed_in(p)
    p.fill("#s-temperature", "0")
    p.fill("#s-max_tokens", str(REPLY))
    p.fill("#chat-system", "You are terse.")
    p.fill("#chat-text", "Write a function that adds two numbers.")
    p.press("#chat-text", "Enter")
    p.wait_for_selector(".message.assistant:not(.streaming) .meta:has-text('finish')")
    shown = p.text_content(".message.assistant .content")
    expected = server.http.post("/v1/chat/completions", json={
        "model": MODEL, "temperature": 0, "max_tokens": REPLY,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Write a function that adds two numbers."}],
    }).json()
    choice = expected["choices"][0]
    assert shown == choice["message"]["content"]
    meta = p.inner_text(".message.assistant .meta")
    assert f"{expected['usage']['completion_tokens']} tokens" in meta and "TTFT" in meta, meta
    assert f"finish: {choice['finish_reason']}" in meta, meta
    assert "tok/s" in meta, meta
    p.screenshot(path=artifacts / "chat.png")

    # a second turn carries the conversation: the page sends both turns
    p.fill("#chat-text", "And subtract?")
    p.press("#chat-text", "Enter")
    p.wait_for_function("document.querySelectorAll('.message.assistant:not(.streaming) .meta').length === 2")
    assert p.locator(".message.user").count() == 2

    # "JSON object" output sends response_format: the reply is the API's constrained one
    p.click("#chat-clear")
    p.fill("#s-max_tokens", "64")
    p.select_option("#s-format", "json_object")
    p.fill("#chat-text", "Reply in JSON.")
    p.press("#chat-text", "Enter")
    p.wait_for_selector(".message.assistant:not(.streaming) .meta:has-text('finish')")
    expected = server.http.post("/v1/chat/completions", json={
        "model": MODEL, "temperature": 0, "max_tokens": 64, "response_format": {"type": "json_object"},
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Reply in JSON."}],
    }).json()["choices"][0]
    assert p.text_content(".message.assistant .content") == expected["message"]["content"]
    assert expected["message"]["content"].startswith("{")
    p.select_option("#s-format", "text")

    # text completion mode against /v1/completions
    p.click("#chat-clear")
    p.select_option("#chat-mode", "completion")
    p.fill("#s-max_tokens", str(REPLY))
    p.fill("#chat-text", "def fibonacci(n):")
    p.press("#chat-text", "Enter")
    p.wait_for_selector(".message.assistant:not(.streaming) .meta:has-text('finish')")
    expected = server.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "def fibonacci(n):", "temperature": 0, "max_tokens": REPLY}).json()
    assert p.text_content(".message.assistant .content") == expected["choices"][0]["text"]

    # A long reply (seconds) is seen growing while its stream is open; Stop ends it, and the server
    # aborts the request and frees its KV blocks. (A short reply from this tiny model may arrive in
    # one chunk: the server coalesces tokens for a reader that is slower than the engine.)
    p.click("#chat-clear")
    p.fill("#s-max_tokens", str(LONG))
    p.fill("#chat-text", "import os")
    p.press("#chat-text", "Enter")
    p.wait_for_selector(".message.assistant.streaming")
    p.evaluate("""() => {
        const reply = document.querySelector('.message.assistant.streaming');
        window.__seen = new Set();
        new MutationObserver(() => {
            if (reply.classList.contains('streaming')) window.__seen.add(reply.querySelector('.content').textContent.length);
        }).observe(reply, {subtree: true, childList: true, characterData: true});
    }""")
    p.wait_for_function("[...window.__seen].filter(n => n > 0).length >= 3")  # three lengths while open
    p.click("#chat-stop")
    p.wait_for_selector(".message.assistant:not(.streaming) .meta:has-text('stopped by you')")
    wait_idle(server)


def test_a_bad_sampling_value_shows_the_servers_error(page, server):
    p = page.page
    signed_in(p)
    p.fill("#s-top_p", "7")
    p.fill("#chat-text", "hello")
    p.press("#chat-text", "Enter")
    p.wait_for_selector("#chat-error:not([hidden])")
    assert "top_p" in p.inner_text("#chat-error")
    assert not p.is_disabled("#chat-send")


def test_metrics_move_with_requests(page, server, artifacts):
    p = page.page
    signed_in(p)
    p.click("#tabs a[data-tab='metrics']")
    p.wait_for_selector("#metrics-totals [data-total='generated tokens']")
    before = server.stats(MODEL)
    # a shared prompt prefix: the second request hits the prefix cache
    prompt = "import os\nimport sys\n" * 24
    outputs = 0
    for _ in range(2):
        response = server.http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 300, "ignore_eos": True, "temperature": 1})
        outputs += response.json()["usage"]["completion_tokens"]
    after = server.stats(MODEL)
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    expected = after["generation_tokens_total"]
    assert expected >= before["generation_tokens_total"] + outputs
    p.wait_for_function(
        f"document.querySelector(\"#metrics-totals [data-total='generated tokens'] b\").textContent === '{expected}'")
    # the throughput and TTFT charts drew the interval that held those tokens
    p.wait_for_function("""() => [...document.querySelectorAll('#chart-throughput g[data-series=generated] polyline')]
        .some(l => l.getAttribute('points').split(' ').length > 1)""")
    assert p.inner_text("#chart-ttft .legend [data-series='since start'] b") not in ("–", "0 ms")
    hit = p.inner_text("#chart-prefix .legend [data-series='since start'] b")
    assert hit.endswith("%") and hit != "0%", hit

    # a long request (a few seconds) shows up as running, then its KV blocks come back
    p.select_option("#metrics-period", "500")
    with long_stream(server):
        p.wait_for_function("document.querySelector(\"#chart-requests .legend [data-series='running'] b\").textContent === '1'")
        p.wait_for_function("document.querySelector(\"#chart-kv .legend [data-series='used'] b\").textContent !== '0'")
        p.screenshot(path=artifacts / "metrics.png", full_page=True)
    p.wait_for_function("document.querySelector(\"#chart-requests .legend [data-series='running'] b\").textContent === '0'")
    p.wait_for_function("document.querySelector(\"#chart-kv .legend [data-series='used'] b\").textContent === '0'")


def test_requests_panel_shows_a_running_request(page, server, artifacts):
    """The Requests tab lists a long streaming request with its state while it runs, then none."""
    p = page.page
    signed_in(p)
    p.click("#tabs a[data-tab='requests']")
    p.wait_for_selector("#requests-table tbody td.hint")
    with long_stream(server):
        p.wait_for_selector("#requests-table tr[data-status='decoding']")
        assert MODEL in p.inner_text("#requests-table tbody")
        p.screenshot(path=artifacts / "requests.png")
    p.wait_for_selector("#requests-table tbody td.hint")


def test_stats_agree_with_prometheus(server):
    """/console/api/stats reads the same engine counters and histograms as /metrics (server idle)."""
    stats = server.stats(MODEL)
    text = httpx.get(server.url + "/metrics").text
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    label = frozenset({("model_name", MODEL)})
    for name, key in [("generation_tokens_total", "generation_tokens_total"), ("prompt_tokens_total", "prompt_tokens_total"),
                      ("prefix_cache_hits_total", "prefix_cache_hits"), ("prefix_cache_queries_total", "prefix_cache_queries"),
                      ("num_requests_running", "num_running"), ("num_preemptions_total", "num_preemptions")]:
        assert samples[("pagedllm_" + name, label)] == stats[key], name
    for name, key in [("time_to_first_token_seconds", "ttft"), ("inter_token_latency_seconds", "itl"),
                      ("e2e_request_latency_seconds", "e2e"), ("request_queue_time_seconds", "queue")]:
        assert samples[(f"pagedllm_{name}_count", label)] == stats["latency_seconds"][key]["count"] > 0, name
        assert samples[(f"pagedllm_{name}_sum", label)] == pytest.approx(stats["latency_seconds"][key]["sum"]), name
    assert stats["kv_blocks_total"] == 256 and stats["kv_blocks_used"] == 0 and stats["kv_cache_usage"] == 0


def test_models_load_and_unload(page, server, artifacts):
    p = page.page
    signed_in(p)
    p.click("#tabs a[data-tab='models']")
    row = "#models-table tr[data-model='{}']"
    p.wait_for_selector(row.format("tiny-qwen2") + "[data-status='available']")
    p.click(row.format("tiny-qwen2") + " button[data-action='load']")
    p.wait_for_selector(row.format("tiny-qwen2") + "[data-status='ready']", timeout=60_000)
    assert server.http.get("/v1/models/tiny-qwen2").json()["status"] == "ready"
    p.wait_for_selector("#chat-model option[value='tiny-qwen2']", state="attached")
    # a folder that is not a model fails to load, with the reason
    p.click(row.format("broken") + " button[data-action='load']")
    p.wait_for_selector(row.format("broken") + "[data-status='failed']", timeout=60_000)
    assert "GPT2LMHeadModel" in p.inner_text(row.format("broken"))
    p.screenshot(path=artifacts / "models.png")
    p.click(row.format("tiny-qwen2") + " button[data-action='unload']")
    p.wait_for_selector(row.format("tiny-qwen2") + "[data-status='available']")
    assert "tiny-qwen2" not in [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    p.wait_for_selector("#chat-model option[value='tiny-qwen2']", state="detached")


STEPS = 320


def test_training_job_from_toml_then_one_from_the_form_cancelled(page, server, tiny_paths, artifacts, tmp_path):
    p = page.page
    signed_in(p)
    p.click("#tabs a[data-tab='jobs']")
    # 320 steps of 512 tokens: long enough that the page, polling every second, sees it run even on
    # a fast idle machine (there 40 steps took about a second: ~25k tokens/s)
    body = job_body(tiny_paths, ranks=1, steps=STEPS, checkpoint_config={"checkpoint_interval_steps": STEPS // 2},
                    data_config={"sequence_length": 64, "global_batch_size": 8, "micro_batch_size": 4},
                    job_name="console-toml")
    p.click("[data-submit='paste']")
    p.fill("#job-text", to_toml(body))
    p.click("#job-paste button[type='submit']")
    p.wait_for_selector("#job-detail h2:has-text('console-toml')")
    job_id = p.inner_text("#job-detail .job-header .mono")
    assert server.http.get(f"/v1/training/jobs/{job_id}").json()["job_name"] == "console-toml"

    # the loss curve grows while the job runs
    wait_count(p, "chart-loss", "train", "n >= 2", timeout=120_000)
    first = chart_count(p, "chart-loss", "train")
    assert first < STEPS, "the job finished before the page saw it run; make it longer"
    wait_count(p, "chart-loss", "train", f"n > {first}", timeout=60_000)
    p.screenshot(path=artifacts / "training-running.png", full_page=True)

    # a second job from the form waits for the slot; cancel it
    p.click("[data-submit='form']")
    p.fill("#job-top-job_name", "console-form")
    p.fill("#job-data_config-dataset_path", str(tiny_paths["corpus"]))
    p.fill("#job-data_config-tokenizer_path", str(tiny_paths["tokenizer"]))
    p.fill("#job-model_config-vocab_size", "384")
    p.fill("#job-data_config-sequence_length", "32")
    p.click("#job-form button[type='submit']")
    p.wait_for_selector("#job-detail h2:has-text('console-form') .badge:has-text('PENDING')")
    form_id = p.inner_text("#job-detail .job-header .mono")
    form_job = server.http.get(f"/v1/training/jobs/{form_id}").json()
    assert form_job["model_config"]["vocab_size"] == 384 and form_job["data_config"]["dataset_path"] == str(tiny_paths["corpus"])
    p.click("#job-detail button[data-action='cancel']")
    p.wait_for_selector("#job-detail h2 .badge:has-text('CANCELLED')")
    assert server.http.get(f"/v1/training/jobs/{form_id}").json()["status"] == "CANCELLED"

    # the fine-tune preset: LoRA on the default model; pointed at a chat file, the server takes it
    # with the base's shape (SmolLM2-135M: hidden size 576, tied embeddings); cancel it too
    chat = tmp_path / "chat.jsonl"
    line = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    chat.write_text((json.dumps(line) + "\n") * 20)
    p.click("#preset-finetune")
    preset = p.input_value("#job-text")
    assert 'base_model = "@default"' in preset and 'method = "lora"' in preset
    p.fill("#job-text", preset.replace('"chat.jsonl"', json.dumps(str(chat))))
    p.click("#job-paste button[type='submit']")
    p.wait_for_selector("#job-detail h2:has-text('finetune-smollm2')")
    tune_id = p.inner_text("#job-detail .job-header .mono")
    tune = server.http.get(f"/v1/training/jobs/{tune_id}").json()
    assert tune["finetune_config"]["base_model"] == "@default" and tune["finetune_config"]["method"] == "lora"
    assert tune["model_config"]["hidden_size"] == 576
    p.click("#job-detail button[data-action='cancel']")
    p.wait_for_selector("#job-detail h2 .badge:has-text('CANCELLED')")

    # back to the first job: it completes with every step on the curves, checkpoints and a log
    p.click(f"#jobs-table tr[data-job-id='{job_id}']")
    p.wait_for_selector("#job-detail h2 .badge:has-text('COMPLETED')", timeout=180_000)
    wait_count(p, "chart-loss", "train", f"n === {STEPS}")
    assert chart_count(p, "chart-lr", "lr") == STEPS
    assert chart_count(p, "chart-loss", "validation") >= 1
    checkpoints = server.http.get(f"/v1/training/jobs/{job_id}/checkpoints").json()
    p.wait_for_function(f"document.querySelectorAll(\"#checkpoints-table tr[data-status='COMPLETE']\").length === {len(checkpoints)}")
    assert {c["step"] for c in checkpoints} >= {STEPS // 2, STEPS}
    log = server.http.get(f"/v1/training/jobs/{job_id}/logs").json()["text"]
    p.wait_for_function("document.querySelector('#job-log').textContent.length > 0")
    assert log.splitlines()[0] in p.inner_text("#job-log")
    metrics = server.http.get(f"/v1/training/jobs/{job_id}/metrics").json()["data"]
    assert float(p.inner_text("[data-total='loss'] b")) == pytest.approx(metrics[-1]["loss"], rel=1e-3)
    p.screenshot(path=artifacts / "training-completed.png", full_page=True)


@pytest.mark.parametrize("bad", ["[model_config\nnum_layers = 2", "{\"data_config\": 1}"])
def test_a_bad_job_file_shows_the_servers_error(page, server, bad):
    p = page.page
    signed_in(p)
    p.click("#tabs a[data-tab='jobs']")
    p.click("[data-submit='paste']")
    p.fill("#job-text", bad)
    p.click("#job-paste button[type='submit']")
    p.wait_for_selector("#submit-error:not([hidden])")
    assert ("not valid TOML" if bad.startswith("[") else "data_config") in p.inner_text("#submit-error")
