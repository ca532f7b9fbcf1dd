"""The real default model with kv_cache_dtype="bfloat16": the KV pool holds bfloat16 (half the
bytes: twice the blocks in the same memory), written rounded as torch rounds and widened exactly
by the C attention kernels. Not exact, so against the float32 pool: teacher-forced greedy
agreement, the factual answer, and perplexity — through the fused decode step (the default) and
through the modules (decode_backend="torch"), prefill included."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_smollm2 import NUM_WINDOWS, WINDOW, greedy_agreement, perplexity, text_windows  # noqa: E402

from pagedllm import LLM  # noqa: E402

MEMORY = 64 << 20


@pytest.fixture(scope="module")
def exact(smollm2):
    return LLM(str(smollm2), kv_cache_memory=MEMORY, int8_activations=False)


@pytest.fixture(scope="module", params=["fused", "torch"])
def bf16(smollm2, request):
    return LLM(str(smollm2), kv_cache_memory=MEMORY, kv_cache_dtype="bfloat16", decode_backend=request.param,
               int8_activations=False)


def test_the_pool_is_bfloat16_with_twice_the_blocks(exact, bf16):
    runner = bf16.llm_engine.runner
    assert runner.kv_cache.k.dtype == torch.bfloat16 and exact.llm_engine.runner.kv_cache.k.dtype == torch.float32
    assert runner.num_blocks == 2 * exact.llm_engine.runner.num_blocks
    fused = runner.model.fused
    assert (fused is not None) == (bf16.llm_engine.config.decode_backend == "fused")
    if fused is not None:
        assert fused._struct.kv_bf16 == 1


def test_greedy_chat_tokens_agree_with_the_float32_pool(exact, bf16):
    agree, total, ours, same = greedy_agreement(exact, bf16)
    print(f"\n[bf16 KV, {bf16.llm_engine.config.decode_backend}] teacher-forced greedy agreement {agree}/{total}; free "
          f"greedy answers equal for the first {same} tokens")
    assert agree >= 0.95 * total  # measured: 104 of 104 on both paths
    assert exact.get_tokenizer().decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."


def test_perplexity_moves_by_less_than_half_a_percent(exact, bf16):
    windows = text_windows(exact)
    base, ours = perplexity(exact, windows), perplexity(bf16, windows)
    print(f"\n[bf16 KV perplexity, {bf16.llm_engine.config.decode_backend}] {NUM_WINDOWS} windows of {WINDOW} tokens: "
          f"float32 pool {base:.4f}, bfloat16 pool {ours:.4f} ({ours / base - 1:+.3%})")
    assert abs(ours / base - 1) < 0.005
