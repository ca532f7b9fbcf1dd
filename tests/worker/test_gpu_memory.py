"""Sizing the KV pool from a GPU's memory (gpu_memory_utilization), fed recorded readings, and the
runner's profiling step that produces the reading (run here on the CPU with the device's
counters replaced by recorded numbers: the step itself, its scratch pool and the rebinding are
real)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.worker.gpu_memory import GiB, MemoryReading, kv_cache_budget
from pagedllm.worker.kv_cache import bytes_per_block
from pagedllm.worker.model_runner import ModelRunner, kv_pool_sizes

# An H100 80GB after loading Llama-3.2-1B in bf16 (2.5 GB) and a 2,048-token profiling step
H100 = MemoryReading(total=85_520_809_984, free=81_200_000_000, reserved=3_700_000_000, peak_allocated=3_400_000_000,
                     scratch=70_000_000)


def test_budget_is_the_share_less_peak_and_memory_outside_torch():
    outside = H100.total - H100.free - H100.reserved  # CUDA context and workspaces: ~0.6 GB
    expected = int(H100.total * 0.9) - (H100.peak_allocated - H100.scratch) - outside
    assert kv_cache_budget(H100, 0.9) == expected
    assert 67 * GiB < expected < 69 * GiB
    assert kv_cache_budget(H100, 0.5) < expected


def test_another_process_on_the_gpu_shrinks_the_budget():
    shared = MemoryReading(H100.total, H100.free - 20 * GiB, H100.reserved, H100.peak_allocated, H100.scratch)
    assert kv_cache_budget(H100, 0.9) - kv_cache_budget(shared, 0.9) == 20 * GiB


def test_no_room_left_is_a_clear_error():
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.04 .* leaves no room for the KV cache"):
        kv_cache_budget(H100, 0.04)


def test_explicit_sizes_win_and_the_budget_is_capped(model_dir):
    config = ModelConfig.from_pretrained(model_dir("llama"))
    per_block = bytes_per_block(config, 16, torch.bfloat16)
    engine = EngineConfig(model="x", dtype="bfloat16", max_num_seqs=4)
    most_useful = 4 * -(-2048 // 16)
    assert kv_pool_sizes(engine, config, 2048, memory_budget=10 * per_block)[0] == 10
    assert kv_pool_sizes(engine, config, 2048, memory_budget=10**6 * per_block)[0] == most_useful
    assert kv_pool_sizes(EngineConfig(model="x", num_kv_blocks=7), config, 2048, memory_budget=10 * per_block)[0] == 7
    with pytest.raises(ValueError, match="less than one KV block"):
        kv_pool_sizes(engine, config, 2048, memory_budget=per_block - 1)


def test_gpu_memory_utilization_is_validated():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="x", gpu_memory_utilization=1.5)


def test_profiling_step_feeds_the_budget(model_dir, monkeypatch):
    runner = ModelRunner(EngineConfig(model=str(model_dir("llama")), max_num_batched_tokens=300, max_num_seqs=7),
                         ModelConfig.from_pretrained(model_dir("llama")), 512)
    pool, kv_cache = runner.model.attention_layers()[0].k_cache, runner.kv_cache
    del runner.kv_cache  # as in the runner's __init__: the real pool does not exist yet
    recorded = {"mem_get_info": lambda device=None: (H100.free, H100.total), "memory_reserved": lambda device=None: H100.reserved,
                "max_memory_allocated": lambda device=None: H100.peak_allocated}
    for name, value in recorded.items():
        monkeypatch.setattr(torch.cuda, name, value)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    budget = runner._profile_kv_budget()
    per_block = bytes_per_block(runner.model.config, runner.block_size, runner.dtype)
    scratch_blocks = sum(-(-n // 16) for n in [43] * 6 + [42])  # 300 tokens over 7 sequences
    assert budget == kv_cache_budget(MemoryReading(H100.total, H100.free, H100.reserved, H100.peak_allocated,
                                                   scratch_blocks * per_block), 0.9)
    for attn in runner.model.attention_layers():
        assert attn.k_cache.numel() == 0  # the scratch pool is unbound again
        attn.bind_cache(pool, pool)
    assert not hasattr(runner, "kv_cache")
    runner.kv_cache = kv_cache
