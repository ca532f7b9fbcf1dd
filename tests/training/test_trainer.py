"""Single-process trainer options: precision, gradient checkpointing, CPU offload, LAMB, optimizer variants."""
from __future__ import annotations

import math

import pytest

from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, run_training

from .helpers import tiny_job

FAST = RunOptions(peak_flops=1e10, export_hf=False)


def losses(paths, tmp_path, name: str, **sections) -> list[float]:
    result = run_training(parse_job(tiny_job(paths, tmp_path / name, **sections)), FAST)
    return [result.losses[s] for s in sorted(result.losses)]


@pytest.fixture(scope="module")
def fp32(tiny_paths, tmp_path_factory) -> list[float]:
    return losses(tiny_paths, tmp_path_factory.mktemp("fp32"), "fp32", memory_config={"zero_stage": 0})


@pytest.mark.parametrize("memory", [
    {"zero_stage": 3, "cpu_offload": True},
    {"zero_stage": 0, "gradient_checkpointing": True, "activation_checkpointing_granularity": "FULL"},
    {"zero_stage": 3, "gradient_checkpointing": True, "activation_checkpointing_granularity": "SELECTIVE"},
])
def test_memory_options_do_not_change_fp32_losses(tiny_paths, tmp_path, fp32, memory):
    assert losses(tiny_paths, tmp_path, "run", memory_config=memory) == pytest.approx(fp32, rel=1e-5)


@pytest.mark.filterwarnings("ignore:Found a non-scalar tensor:UserWarning")  # inside ShardedGradScaler
@pytest.mark.parametrize("memory", [
    {"zero_stage": 0, "precision": "BF16"},  # autocast
    {"zero_stage": 3, "precision": "BF16"},  # FSDP MixedPrecisionPolicy
    {"zero_stage": 0, "precision": "FP16"},  # autocast + GradScaler
    {"zero_stage": 3, "precision": "FP16"},  # MixedPrecisionPolicy + ShardedGradScaler
])
def test_low_precision_tracks_fp32(tiny_paths, tmp_path, fp32, memory):
    got = losses(tiny_paths, tmp_path, "run", memory_config=memory)
    assert all(math.isfinite(x) for x in got)
    assert got == pytest.approx(fp32, rel=2e-2)


@pytest.mark.parametrize("optimizer", ["ADAM", "LAMB"])
def test_other_optimizers_train(tiny_paths, tmp_path, optimizer):
    got = losses(tiny_paths, tmp_path, "run", optimization_config={"optimizer": optimizer, "total_steps": 12,
                                                                     "learning_rate": 1e-2})
    assert all(math.isfinite(x) for x in got) and min(got[-3:]) < got[0]
