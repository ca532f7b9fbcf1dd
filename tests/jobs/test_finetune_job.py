"""A fine-tune through the job API: a finetune_config job on a tiny model runs to COMPLETED and
leaves its PEFT adapter; a bad dataset line and a base model outside the allowed folders are 400s
naming their field."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .helpers import assert_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="module")
def finetune_paths(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("finetune-job")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"x{i} =", "completion": f" {i}"}) + "\n" for i in range(12)))
    return {"base": build_model(root / "base", "llama", tie_word_embeddings=True), "chat": chat, "root": root}


def body(paths: dict, **finetune) -> dict:
    return {"job_name": "finetune", "log_interval_steps": 1,
            "finetune_config": {"base_model": str(paths["base"]), "method": "lora", "lora_rank": 2, **finetune},
            "data_config": {"dataset_path": str(paths["chat"]), "sequence_length": 64, "global_batch_size": 2,
                            "micro_batch_size": 1},
            "optimization_config": {"total_steps": 4, "warmup_steps": 1, "learning_rate": 1e-2},
            "memory_config": {"zero_stage": 0}}


def test_a_lora_job_runs_to_completed_and_leaves_its_adapter(server, finetune_paths):
    job_id = server.submit(body(finetune_paths))
    done = server.wait_status(job_id, "COMPLETED", timeout=180)
    assert done["metrics"]["step"] == 4
    adapter = server.data_dir / "jobs" / job_id / "checkpoints" / "adapter-final"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 2
    assert (adapter / "adapter_model.safetensors").is_file()


def test_bad_finetune_inputs_are_400s_naming_the_field(server, finetune_paths, tmp_path_factory):
    bad = finetune_paths["root"] / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"messages": "no"}) + "\n")
    request = {**body(finetune_paths), "data_config": {**body(finetune_paths)["data_config"], "dataset_path": str(bad)}}
    assert_error(server.client.post("/v1/training/jobs", json=request), 400, "data_config.dataset_path", f"{bad}:2:")
    assert_error(server.client.post("/v1/training/jobs", json=body(finetune_paths, base_model="/etc")), 400,
                 "finetune_config.base_model")
    assert_error(server.client.post("/v1/training/jobs", json=body(finetune_paths, method="dora")), 400,
                 "finetune_config.method")
