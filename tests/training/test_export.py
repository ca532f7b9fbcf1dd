"""Acceptance: the exported folder loads in transformers and in pagedllm, and both decode the same greedy tokens."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, run_training

from .helpers import tiny_job

PROMPTS = ["def parse(text):\n    ", "import os\n", "class Heap:"]


@pytest.fixture(scope="module")
def trained(tiny_paths, tmp_path_factory):
    """A tiny llama trained a few steps; initializer_range 0.1 keeps greedy decoding away from float ties."""
    ckpt = tmp_path_factory.mktemp("export") / "run"
    job = tiny_job(tiny_paths, ckpt, model_config={"initializer_range": 0.1}, optimization_config={"total_steps": 8})
    run_training(parse_job(job), RunOptions(peak_flops=1e10))
    return ckpt


def test_end_of_training_writes_hf_final_and_a_loss_curve(trained):
    folder = trained / "hf-final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in folder.iterdir()}
    assert (trained / "loss_curve.png").stat().st_size > 1000
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_tokens"} <= set(records[0])
    assert records[-1]["consumed_tokens"] == 8 * 8 * 32 and "val_loss" in records[-1]


def test_export_cli_writes_the_same_weights(trained, tmp_path):
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "pagedllm.training.cli", "export", "--checkpoint", str(trained),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    a, b = load_file(out / "model.safetensors"), load_file(trained / "hf-final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_exported_folder_gives_the_same_greedy_tokens_in_transformers_and_pagedllm(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm import LLM, SamplingParams

    folder = trained / "hf-final"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=16, do_sample=False)
        expected.append(out[0, ids.shape[1]:].tolist())
    outputs = LLM(str(folder)).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


@pytest.fixture(scope="module")
def trained_moe(tiny_paths, tmp_path_factory):
    """A tiny mixture of experts trained a few steps, exported as a MixtralForCausalLM folder."""
    ckpt = tmp_path_factory.mktemp("export-moe") / "run"
    model = {"architecture": "moe", "num_experts": 4, "num_experts_per_token": 2, "initializer_range": 0.1}
    job = tiny_job(tiny_paths, ckpt, model_config=model, optimization_config={"total_steps": 6})
    run_training(parse_job(job), RunOptions(peak_flops=1e10))
    return ckpt / "hf-final"


def test_exported_moe_serves_the_same_greedy_tokens_as_transformers(trained_moe, tmp_path):
    """The trainer's MoE, exported, through a real `pagedllm serve` and the openai client."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.entrypoints.serve import launch

    assert json.loads((trained_moe / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(trained_moe)
    hf = AutoModelForCausalLM.from_pretrained(trained_moe)
    server = launch(["--model", str(trained_moe), "--served-model-name", "moe", "--data-dir", str(tmp_path / "data")],
                    tmp_path / "server.log", timeout=120)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                expected = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
            answer = client.completions.create(model="moe", prompt=prompt, max_tokens=12, temperature=0)
            assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True), prompt
    finally:
        server.stop()
