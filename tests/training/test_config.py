"""The TrainingJob config: defaults, TOML/JSON loading, overrides, and every validation rule naming its field."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm.training.config import (
    ConfigError,
    TrainingJob,
    apply_overrides,
    load_job,
    parse_job,
    resolve,
)

MINIMAL = {"data_config": {"dataset_path": "corpus", "tokenizer_path": "tok"}}


MOE = {"architecture": "moe", "num_experts": 4, "num_experts_per_token": 2}


def job_with(**sections) -> TrainingJob:
    data = json.loads(json.dumps(MINIMAL))
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return parse_job(data)


def test_seed_field_names_and_defaults():
    dumped = job_with().model_dump(mode="json")
    assert {"job_id", "job_name", "status", "created_at", "updated_at", "model_config", "parallelism_config",
            "optimization_config", "memory_config", "data_config", "checkpoint_config"} <= set(dumped)
    assert {"architecture", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "intermediate_size",
            "vocab_size", "max_position_embeddings", "num_experts", "num_experts_per_token"} <= set(dumped["model_config"])
    assert {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "expert_parallel_size",
            "sequence_parallel", "context_parallel_size"} <= set(dumped["parallelism_config"])
    assert {"optimizer", "learning_rate", "weight_decay", "beta1", "beta2", "epsilon", "gradient_clipping",
            "warmup_steps", "total_steps", "lr_scheduler"} <= set(dumped["optimization_config"])
    assert {"precision", "zero_stage", "gradient_checkpointing", "cpu_offload", "nvme_offload",
            "activation_checkpointing_granularity"} <= set(dumped["memory_config"])
    assert {"checkpoint_dir", "checkpoint_interval_steps", "checkpoint_interval_minutes", "max_checkpoints_to_keep",
            "async_save"} <= set(dumped["checkpoint_config"])
    assert dumped["status"] == "PENDING" and dumped["parallelism_config"]["data_parallel_size"] is None
    assert TrainingJob.model_validate_json(job_with().model_dump_json()).model_dump() is not None


def test_toml_and_json_load_the_same_job(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('job_name = "x"\n[data_config]\ndataset_path = "c"\ntokenizer_path = "t"\n'
                    '[memory_config]\nzero_stage = 2\nprecision = "BF16"\n')
    as_json = tmp_path / "job.json"
    as_json.write_text(json.dumps({"job_name": "x", "data_config": {"dataset_path": "c", "tokenizer_path": "t"},
                                   "memory_config": {"zero_stage": 2, "precision": "BF16"}}))
    a, b = load_job(toml), load_job(as_json)
    assert a.memory.zero_stage == b.memory.zero_stage == 2 and a.memory.precision == b.memory.precision
    with pytest.raises(ConfigError, match="--config"):
        load_job(tmp_path / "job.yaml")


def test_overrides_parse_json_values():
    job = apply_overrides(job_with(), ["optimization_config.total_steps=7", 'memory_config.precision="FP16"',
                                       "job_name=renamed"])
    assert job.optimization.total_steps == 7 and job.memory.precision.value == "FP16" and job.job_name == "renamed"
    with pytest.raises(ConfigError, match="nosuch"):  # unknown sections are rejected by name
        apply_overrides(job_with(), ["nosuch.field=1"])


@pytest.mark.parametrize("sections, world, field", [
    ({"parallelism_config": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2}}, 4,
     "parallelism_config.data_parallel_size"),
    ({"parallelism_config": {"tensor_parallel_size": 3}}, 4, "parallelism_config.tensor_parallel_size"),
    ({"data_config": {"global_batch_size": 10, "micro_batch_size": 2}}, 2, "data_config.global_batch_size"),
    ({"model_config": {"num_attention_heads": 6, "num_kv_heads": 6, "hidden_size": 384},
      "parallelism_config": {"tensor_parallel_size": 4}}, 4, "model_config.num_attention_heads"),
    ({"model_config": {"num_attention_heads": 4, "num_kv_heads": 1}, "parallelism_config": {"tensor_parallel_size": 2}},
     2, "model_config.num_kv_heads"),
    ({"model_config": {"num_layers": 2}, "parallelism_config": {"pipeline_parallel_size": 4}}, 4, "model_config.num_layers"),
    ({"model_config": {"num_layers": 4}, "parallelism_config": {"pipeline_parallel_size": 4,
     "pipeline_schedule": "INTERLEAVED_1F1B"}}, 4, "model_config.num_layers"),
    ({"parallelism_config": {"expert_parallel_size": 2}}, 2, "parallelism_config.expert_parallel_size"),  # not moe
    ({"model_config": MOE, "parallelism_config": {"expert_parallel_size": 4}}, 2, "parallelism_config.expert_parallel_size"),
    ({"model_config": {**MOE, "num_experts": 3}, "parallelism_config": {"expert_parallel_size": 2}}, 2,
     "parallelism_config.expert_parallel_size"),
    ({"model_config": MOE, "parallelism_config": {"expert_parallel_size": 2}, "memory_config": {"zero_stage": 0}}, 2,
     "parallelism_config.expert_parallel_size"),
    ({"parallelism_config": {"context_parallel_size": 3}}, 3, "data_config.sequence_length"),  # 512 % 6
    ({"memory_config": {"nvme_offload": True, "zero_stage": 0}}, 1, "memory_config.nvme_offload"),
    ({"model_config": MOE, "memory_config": {"precision": "FP8"}, "parallelism_config": {"tensor_parallel_size": 2}}, 2,
     "memory_config.precision"),  # tp-replicated experts compute on local weights, not through Float8Linear
    ({"model_config": {"architecture": "moe"}}, 1, "model_config.num_experts"),
    ({"model_config": {"architecture": "moe", "num_experts": 4, "num_experts_per_token": 5}}, 1,
     "model_config.num_experts_per_token"),
    ({"data_config": {"sequence_length": 4096}}, 1, "data_config.sequence_length"),
    ({"data_config": {"global_batch_size": 4, "micro_batch_size": 2}, "parallelism_config": {"pipeline_parallel_size": 4},
      "model_config": {"num_layers": 4}}, 4, "data_config.global_batch_size"),
])
def test_invalid_configs_name_their_field(sections, world, field):
    with pytest.raises(ConfigError) as info:
        resolve(job_with(**sections), world)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_expert_and_context_parallel_sizes_are_accepted():
    """EP borrows its ranks from data parallelism; CP multiplies the world like TP does."""
    job = resolve(job_with(model_config=MOE, parallelism_config={"expert_parallel_size": 2}), 4)
    assert job.parallelism.data_parallel_size == 4
    job = resolve(job_with(parallelism_config={"context_parallel_size": 2}), 4)
    assert job.parallelism.data_parallel_size == 2


FINETUNE = {"data_config": {"dataset_path": "chat.jsonl"}}


def finetune_with(method: str, **parallelism) -> TrainingJob:
    return parse_job({**FINETUNE, "finetune_config": {"method": method}, "parallelism_config": parallelism})


@pytest.mark.parametrize("parallelism", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_full_finetune_resolves_under_tensor_and_pipeline_parallelism(parallelism):
    assert resolve(finetune_with("full", **parallelism), 2).parallelism.data_parallel_size == 1


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_adapters_run_under_pipeline_parallelism(method):
    assert resolve(finetune_with(method, pipeline_parallel_size=2), 2).parallelism.pipeline_parallel_size == 2


def test_lora_but_not_qlora_runs_under_tensor_parallelism():
    """QLoRA's quantized blocks are not sharded (docs/training.md)."""
    assert resolve(finetune_with("lora", tensor_parallel_size=2), 2).parallelism.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="qlora with tensor parallelism is not supported") as info:
        resolve(finetune_with("qlora", tensor_parallel_size=2), 2)
    assert info.value.field == "parallelism_config.tensor_parallel_size"


def test_finetune_refuses_sequence_parallelism_by_name():
    with pytest.raises(ConfigError) as info:
        resolve(finetune_with("full", tensor_parallel_size=2, sequence_parallel=True), 2)
    assert info.value.field == "parallelism_config.sequence_parallel"


@pytest.mark.parametrize("sections, world, dp", [
    ({"model_config": MOE, "parallelism_config": {"tensor_parallel_size": 2}}, 4, 2),
    ({"model_config": MOE, "parallelism_config": {"tensor_parallel_size": 2, "expert_parallel_size": 2}}, 4, 2),
    ({"model_config": MOE, "parallelism_config": {"context_parallel_size": 2}}, 4, 2),
    ({"parallelism_config": {"context_parallel_size": 2, "tensor_parallel_size": 2}}, 4, 1),
    ({"parallelism_config": {"context_parallel_size": 2, "pipeline_parallel_size": 2}}, 4, 1),
    ({"model_config": MOE, "parallelism_config": {"expert_parallel_size": 2, "context_parallel_size": 2}}, 4, 2),
    ({"model_config": MOE, "parallelism_config": {"expert_parallel_size": 2, "pipeline_parallel_size": 2}}, 4, 2),
])
def test_compositions_of_issue_42_are_accepted(sections, world, dp):
    """MoE / EP with TP, CP with a moe, CP with TP: built (parity tests in test_expert_parallel.py and
    test_context_parallel.py), no longer refused."""
    assert resolve(job_with(**sections), world).parallelism.data_parallel_size == dp


def test_fp8_resolves_where_float8_runs():
    """Emulated on a CPU, native on compute capability >= 8.9; an older GPU is refused naming the field."""
    import torch

    job = job_with(memory_config={"precision": "FP8", "fp8_recipe": "rowwise"})
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ConfigError, match="compute capability >= 8.9"):
            resolve(job, 1)
    else:
        assert resolve(job, 1).memory.fp8_recipe.value == "rowwise"


DATA = {"dataset_path": "corpus", "tokenizer_path": "tok"}


@pytest.mark.parametrize("data, field", [
    ({"data_config": DATA, "model_config": {"architecture": "gpt2"}}, "model_config.architecture"),
    ({"data_config": DATA, "memory_config": {"zero_stage": 4}}, "memory_config.zero_stage"),
    ({"data_config": DATA, "optimization_config": {"optimizer": "SGD"}}, "optimization_config.optimizer"),
    ({"data_config": DATA, "model_config": {"hidden_sizes": 3}}, "model_config.hidden_sizes"),
    ({"data_config": {"dataset_path": "corpus"}}, "data_config.tokenizer_path"),
])
def test_field_errors_name_their_field(data, field):
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    assert info.value.field == field


def test_data_parallel_size_is_derived():
    job = resolve(job_with(parallelism_config={"tensor_parallel_size": 2}, data_config={"global_batch_size": 16}), 8)
    assert job.parallelism.data_parallel_size == 4


def test_cli_rejects_invalid_config_before_any_process_starts(tmp_path):
    """tp x pp x dp != world: exit 2 naming the field, no checkpoint dir, no torchrun."""
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"data_config": {"dataset_path": str(tmp_path), "tokenizer_path": str(tmp_path)},
                                  "parallelism_config": {"tensor_parallel_size": 2, "data_parallel_size": 2},
                                  "checkpoint_config": {"checkpoint_dir": str(tmp_path / "ck")}}))
    proc = subprocess.run([sys.executable, "-m", "pagedllm.training.cli", "train", "--config", str(config),
                           "--nproc-per-node", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "parallelism_config.data_parallel_size" in proc.stderr and "world size 2" in proc.stderr
    assert not (tmp_path / "ck").exists()


def test_check_job_validates_a_job_in_memory(tmp_path):
    """What the job service calls: the same checks as `pagedllm train`, without a config file."""
    from pagedllm.training.cli import check_job

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    job = job_with(data_config={"dataset_path": str(tmp_path / "missing"), "tokenizer_path": str(tmp_path / "tok")})
    with pytest.raises(ConfigError) as info:
        check_job(job, 1)
    assert info.value.field == "data_config.dataset_path"
    job = job_with(data_config={"dataset_path": str(tmp_path), "tokenizer_path": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="^data_config.tokenizer_path"):
        check_job(job, 1)
    ok = job_with(data_config={"dataset_path": str(tmp_path), "tokenizer_path": str(tmp_path / "tok")})
    assert check_job(ok, 1) is ok
    with pytest.raises(ConfigError, match="^parallelism_config"):
        check_job(ok.model_copy(update={"parallelism": ok.parallelism.model_copy(update={"tensor_parallel_size": 2})}), 3)
