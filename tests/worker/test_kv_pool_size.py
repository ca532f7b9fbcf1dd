"""The KV pool's default size: one full context shared by the running sequences (llama.cpp's
n_ctx), capped by a quarter of free memory — not a quarter of free memory whatever the model
(the default model held 4.8 GB of KV that way, 0.36 GB now). Sizes given by the caller win."""
from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.worker import model_runner
from pagedllm.worker.kv_cache import bytes_per_block
from pagedllm.paths import default_model

GIB = 1 << 30


def pool(model: str, max_model_len: int, **engine) -> tuple[int, int]:
    """(blocks, bytes) of the pool `kv_pool_sizes` gives the model's config."""
    config, model_config = EngineConfig(model, **engine), ModelConfig.from_pretrained(model)
    blocks, _ = model_runner.kv_pool_sizes(config, model_config, max_model_len)
    return blocks, blocks * bytes_per_block(model_config, config.block_size, config.kv_torch_dtype(model_config))


def test_the_default_model_at_rest_holds_under_1_gb_of_kv():
    model = str(default_model())
    blocks, size = pool(model, 8192)
    assert blocks * 16 == 8192 and size < GIB, size  # one 8,192-token context: 360 MiB in float32
    assert pool(model, 8192, max_num_batched_tokens=16384)[0] * 16 == 16384  # at least one step's tokens


def test_the_pool_is_capped_by_free_memory(monkeypatch):
    model = str(default_model())
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: 4 * GIB // 10)  # 0.1 GiB for the pool
    blocks, size = pool(model, 8192)
    assert size <= GIB // 10 and blocks < 512


def test_a_given_fraction_or_size_wins(monkeypatch):
    model = str(default_model())
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: 64 * GIB)
    assert pool(model, 8192, kv_cache_memory_fraction=0.25)[1] > 10 * GIB  # the old rule, when asked for
    assert pool(model, 8192, num_kv_blocks=7)[0] == 7
    assert pool(model, 8192, kv_cache_memory=GIB)[1] <= GIB


def test_an_engine_allocates_the_default_pool(model_dir):
    """The runner's tensors are the size the rule says (a tiny model, max_model_len 256)."""
    llm = LLM(str(model_dir("llama")), max_model_len=256, max_num_batched_tokens=128)
    runner = llm.llm_engine.runner
    assert runner.num_blocks * 16 == 256
    assert runner.kv_cache.k.shape[1] == runner.num_blocks
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig("x", kv_cache_memory_fraction=0.95)
