"""The real default model with kv_cache_dtype="bfloat16" or "float16": the KV pool holds half-width
elements (half the bytes: twice the blocks in the same memory), written rounded as torch rounds
and widened exactly by the C attention kernels. Not exact, so against the float32 pool:
teacher-forced greedy agreement, the factual answer, and perplexity — through the fused decode
step (the default) and through the modules (decode_backend="torch"), prefill included."""
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


@pytest.fixture(scope="module", params=[(kv, backend) for kv in ("bfloat16", "float16") for backend in ("fused", "torch")],
                ids=lambda p: "-".join(p))
def half(smollm2, request):
    kv, backend = request.param
    return LLM(str(smollm2), kv_cache_memory=MEMORY, kv_cache_dtype=kv, decode_backend=backend, int8_activations=False)


def label(llm: LLM) -> str:
    return f"{llm.llm_engine.config.kv_cache_dtype} KV, {llm.llm_engine.config.decode_backend}"


def test_the_pool_is_half_width_with_twice_the_blocks(exact, half):
    runner, kv = half.llm_engine.runner, half.llm_engine.config.kv_cache_dtype
    assert runner.kv_cache.k.dtype == getattr(torch, kv) and exact.llm_engine.runner.kv_cache.k.dtype == torch.float32
    assert runner.num_blocks == 2 * exact.llm_engine.runner.num_blocks
    fused = runner.model.fused
    assert (fused is not None) == (half.llm_engine.config.decode_backend == "fused")
    if fused is not None:
        assert fused._struct.kv_dtype == {"bfloat16": 1, "float16": 2}[kv]


def test_greedy_chat_tokens_agree_with_the_float32_pool(exact, half):
    agree, total, ours, same = greedy_agreement(exact, half)
    print(f"\n[{label(half)}] teacher-forced greedy agreement {agree}/{total}; free greedy answers equal for the first "
          f"{same} tokens")
    assert agree >= 0.95 * total  # measured: 104 of 104 on all four
    assert exact.get_tokenizer().decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."


def test_perplexity_moves_by_less_than_half_a_percent(exact, half):
    """Measured: bfloat16 -0.03 / -0.02 %, float16 +0.004 / +0.002 % (fused / modules)."""
    windows = text_windows(exact)
    base, ours = perplexity(exact, windows), perplexity(half, windows)
    print(f"\n[{label(half)} perplexity] {NUM_WINDOWS} windows of {WINDOW} tokens: float32 pool {base:.4f}, half pool "
          f"{ours:.4f} ({ours / base - 1:+.3%})")
    assert abs(ours / base - 1) < 0.005
