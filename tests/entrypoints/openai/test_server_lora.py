"""LoRA adapters over a real `pagedllm serve` with the official openai client: --lora-modules at
start, /v1/load_lora_adapter and /v1/unload_lora_adapter at run time, `model: <adapter>` picks the
adapter (its greedy tokens are transformers + PEFT's), /v1/models lists adapters with their parent;
a bad adapter is a 400 naming why and the server keeps serving; unloading while requests run
leaves no KV block held."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest
from lora_adapters import make_peft_adapter, peft_greedy
from server_process import assert_error, start_server
from tiny_models import build_model, load_reference

PROMPT = [5, 17, 99, 200, 31, 7, 8, 9, 40, 41]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = build_model(root / "base", "llama")
    other = build_model(root / "other", "llama", hidden_size=32, intermediate_size=64)
    return {
        "base": base,
        "attn": make_peft_adapter(base, root / "attn", 4, 8, ["q_proj", "v_proj", "o_proj"], 0),
        "mlp": make_peft_adapter(base, root / "mlp", 8, 16, ["gate_proj", "up_proj", "down_proj"], 1),
        "rank": make_peft_adapter(base, root / "rank", 16, 16, ["q_proj"], 2),
        "other": make_peft_adapter(other, root / "for-other", 2, 2, ["q_proj"], 3),
    }


@pytest.fixture(scope="module")
def srv(lora_files, tmp_path_factory):
    server = start_server(["--model", str(lora_files["base"]), "--served-model-name", "tiny", "--enable-lora",
                           "--lora-dtype", "float32", "--lora-modules", f"attn={lora_files['attn']}", "--max-loras", "2",
                           "--max-lora-rank", "8",
                           "--num-kv-blocks", "256", "--block-size", "4"],
                          tmp_path_factory.mktemp("lora-logs") / "server.log")
    yield server
    server.stop()
    assert "Traceback" not in server.log.read_text()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)


def greedy_ids(client, model: str) -> list[int]:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    return [int(t.split(":")[1]) for t in reply.choices[0].logprobs.tokens]


def test_adapters_are_served_like_peft(client, srv, lora_files):
    expected = {name: peft_greedy(lambda: load_reference(lora_files["base"]), lora_files.get(name), [PROMPT], NEW_TOKENS)[0]
                for name in (None, "attn", "mlp")}
    assert expected["attn"] != expected[None] and expected["mlp"] != expected[None]
    assert greedy_ids(client, "tiny") == expected[None]
    assert greedy_ids(client, "attn") == expected["attn"]
    loaded = httpx.post(srv.base_url + "/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(lora_files["mlp"])})
    assert loaded.status_code == 200, loaded.text
    assert greedy_ids(client, "mlp") == expected["mlp"]
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "attn", "mlp"}
    assert cards["attn"].parent == "tiny" and cards["mlp"].parent == "tiny" and getattr(cards["tiny"], "parent", None) is None
    assert client.models.retrieve("mlp").root == str(lora_files["mlp"])
    console = {m["id"]: m for m in httpx.get(srv.url + "/console/api/models").json()["data"]}  # the console's model picker
    assert console["mlp"]["status"] == "ready" and console["mlp"]["parent"] == "tiny" and console["tiny"]["parent"] is None
    assert greedy_ids(client, "tiny") == expected[None]  # the base's own prompt blocks were never the adapters'


@pytest.mark.parametrize("kind,why", [("rank", "rank r=16 exceeds max_lora_rank=8"), ("other", "made for another base model"),
                                      ("missing", "has no adapter_config.json")])
def test_bad_adapter_is_a_400_naming_why(client, srv, lora_files, kind, why):
    path = str(lora_files.get(kind, lora_files["base"] / "no-such-adapter"))
    response = httpx.post(srv.base_url + "/load_lora_adapter", json={"lora_name": f"bad-{kind}", "lora_path": path})
    assert_error(response, 400, "lora_path", why)
    assert f"bad-{kind}" not in {m.id for m in client.models.list().data}
    assert greedy_ids(client, "attn")  # still serving


def test_unknown_adapter_names(srv):
    assert_error(httpx.post(srv.base_url + "/unload_lora_adapter", json={"lora_name": "nope"}), 404)
    assert_error(httpx.post(srv.base_url + "/load_lora_adapter", json={"lora_name": "tiny", "lora_path": "/x"}), 400, "lora_name")
    response = httpx.post(srv.base_url + "/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 404


def test_beam_search_with_an_adapter_is_refused_by_name(srv):
    response = httpx.post(srv.base_url + "/completions", json={"model": "attn", "prompt": PROMPT, "max_tokens": 2,
                                                               "use_beam_search": True, "n": 2})
    assert_error(response, 400, "use_beam_search", "LoRA")


def test_unload_while_requests_run_leaves_nothing_held(client, srv, lora_files):
    loaded = httpx.post(srv.base_url + "/load_lora_adapter", json={"lora_name": "busy", "lora_path": str(lora_files["mlp"])})
    assert loaded.status_code == 200, loaded.text
    results, errors, running = [], [], threading.Event()

    def generate() -> None:
        try:
            stream = client.completions.create(model="busy", prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            count = 0
            for _ in stream:
                count += 1
                running.set()
            results.append(count)
        except openai.APIError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=generate) for _ in range(4)]
    for t in threads:
        t.start()
    assert running.wait(30), "no request started streaming"
    unloaded = httpx.post(srv.base_url + "/unload_lora_adapter", json={"lora_name": "busy"})
    assert unloaded.status_code == 200, unloaded.text
    for t in threads:
        t.join(60)
    assert len(results) + len(errors) == 4 and all(isinstance(e, openai.NotFoundError) for e in errors)
    assert "busy" not in {m.id for m in client.models.list().data}
    srv.wait_idle("tiny")
    assert_error(httpx.post(srv.base_url + "/completions", json={"model": "busy", "prompt": "hi", "max_tokens": 1}), 404)
    assert greedy_ids(client, "attn")
