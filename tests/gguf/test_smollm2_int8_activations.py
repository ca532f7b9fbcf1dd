"""The real default model (SmolLM2-135M-Instruct, Q4_1 / Q8_0 blocks) with the opt-in engine
argument int8_activations: every block-quantized matmul (decode steps and prefills) multiplies
activations quantized to int8 per block of 32, llama.cpp's way (csrc/small_matmul.c). Not exact,
so against the exact path: greedy chat tokens agree for most tokens, and perplexity moves by
less than 1 %."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_smollm2 import NUM_WINDOWS, WINDOW, greedy_agreement, perplexity, text_windows  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.layers.small_matmul import WEIGHT_Q4, WEIGHT_Q8_0  # noqa: E402


@pytest.fixture(scope="module")
def exact(smollm2):
    return LLM(str(smollm2), kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def int8(smollm2):
    return LLM(str(smollm2), kv_cache_memory=64 << 20, int8_activations=True)


def test_the_mode_reaches_every_block_quantized_matrix(exact, int8):
    fused = int8.llm_engine.runner.model.fused
    assert fused is not None
    matrices = [fused._lm_head, *(getattr(layer, name) for layer in fused._layers for name in ("qkv", "o", "gate_up", "down"))]
    assert {m.dtype for m in matrices} == {WEIGHT_Q4, WEIGHT_Q8_0}
    assert all(m.int8_activations == 1 for m in matrices)
    assert exact.llm_engine.runner.model.fused._lm_head.int8_activations == 0


def test_int8_activations_need_block_quantized_weights(smollm2):
    with pytest.raises(ValueError, match="int8_activations"):
        LLM(str(smollm2), quantization="none", int8_activations=True)


def test_greedy_chat_tokens_agree_with_the_exact_path(exact, int8):
    """Teacher-forced on the exact path's answers, the int8 engine's own greedy choice (its top
    prompt logprob) is the exact path's next token at >= 90 % of the positions. Free greedy
    answers part ways at the first differing token (they are printed) but answer the first
    question as the exact path does."""
    agree, total, ours, same = greedy_agreement(exact, int8)
    print(f"\n[int8 activations] teacher-forced greedy agreement {agree}/{total}; free greedy answers equal for the "
          f"first {same} tokens")
    assert agree >= 0.9 * total  # measured: 101 of 104
    assert exact.get_tokenizer().decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."


def test_perplexity_moves_by_less_than_one_percent(exact, int8):
    windows = text_windows(exact)
    base, ours = perplexity(exact, windows), perplexity(int8, windows)
    print(f"\n[int8 activations perplexity] {NUM_WINDOWS} windows of {WINDOW} tokens: exact {base:.4f}, "
          f"int8 activations {ours:.4f} ({ours / base - 1:+.3%})")
    assert abs(ours / base - 1) < 0.01
