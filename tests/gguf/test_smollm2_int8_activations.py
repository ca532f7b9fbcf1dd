"""The real default model (SmolLM2-135M-Instruct, Q4_1 / Q8_0 blocks) as it runs by default:
int8 activations (engine argument int8_activations, on by default for block-quantized weights)
in its decode steps — every block-quantized matmul multiplies activations quantized to int8 per
block of 32, llama.cpp's way (csrc/small_matmul.c) — while steps that process prompts keep fp32
activations, so a prompt's KV and first token are the exact path's however the prompt was split
or cached. Not exact, so against the exact path; the quality bound (teacher-forced greedy
agreement, perplexity) is measured with int8 activations at every position
(runner.int8_every_step), which is what llama.cpp does."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_smollm2 import NUM_WINDOWS, QUESTIONS, WINDOW, chat, greedy_agreement, perplexity, text_windows  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.layers.small_matmul import WEIGHT_Q4, WEIGHT_Q8_0  # noqa: E402


@pytest.fixture(scope="module")
def exact(smollm2):
    return LLM(str(smollm2), kv_cache_memory=64 << 20, int8_activations=False)


@pytest.fixture(scope="module")
def int8(smollm2):
    """The default engine: no argument asks for int8 activations."""
    return LLM(str(smollm2), kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def int8_everywhere(smollm2):
    """int8 activations at every position, prompts included: the bound of the default's cost."""
    llm = LLM(str(smollm2), kv_cache_memory=64 << 20)
    llm.llm_engine.runner.int8_every_step = True
    return llm


def test_the_mode_reaches_every_block_quantized_matrix(exact, int8):
    fused = int8.llm_engine.runner.model.fused
    assert fused is not None
    matrices = [fused._lm_head, *(getattr(layer, name) for layer in fused._layers for name in ("qkv", "o", "gate_up", "down"))]
    assert {m.dtype for m in matrices} == {WEIGHT_Q4, WEIGHT_Q8_0}
    assert all(m.int8_activations == 1 for m in matrices)
    assert exact.llm_engine.runner.model.fused._lm_head.int8_activations == 0
    assert int8.llm_engine.config.int8_activations is True


def test_int8_activations_need_block_quantized_weights(smollm2):
    with pytest.raises(ValueError, match="int8_activations"):
        LLM(str(smollm2), quantization="none", int8_activations=True)


def test_prompts_are_exact_and_decodes_are_int8(exact, int8):
    """A prompt's first-token logprobs are the exact path's (to float32 rounding), whole or
    hitting the prefix cache: with int8 activations there too, this near-tie (0.08 nats) moved
    by 0.05 with the way the prompt was split, and the repeated question was answered wrongly.
    A decode step runs with int8 activations."""
    prompt = {"prompt_token_ids": chat(exact.get_tokenizer(), QUESTIONS[0])}
    scored = SamplingParams(max_tokens=1, logprobs=2, temperature=0)
    (want,) = exact.generate([prompt], scored, use_tqdm=False)[0].outputs[0].logprobs
    for _ in range(2):  # the second finds its blocks in the prefix cache
        (got,) = int8.generate([prompt], scored, use_tqdm=False)[0].outputs[0].logprobs
        assert list(got) == list(want) and all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in want), (got, want)
    runner = int8.llm_engine.runner
    int8.generate([prompt], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert runner._int8_now is True and runner.model.fused._lm_head.int8_activations == 1


def test_greedy_chat_tokens_agree_with_the_exact_path(exact, int8_everywhere):
    """Teacher-forced on the exact path's answers, the int8 engine's own greedy choice (its top
    prompt logprob) is the exact path's next token at >= 90 % of the positions. Free greedy
    answers part ways at the first differing token (they are printed) but answer the first
    question as the exact path does."""
    agree, total, ours, same = greedy_agreement(exact, int8_everywhere)
    print(f"\n[int8 activations] teacher-forced greedy agreement {agree}/{total}; free greedy answers equal for the "
          f"first {same} tokens")
    assert agree >= 0.9 * total  # measured: 101 of 104
    assert exact.get_tokenizer().decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."


def test_perplexity_moves_by_less_than_one_percent(exact, int8, int8_everywhere):
    windows = text_windows(exact)
    base, ours = perplexity(exact, windows), perplexity(int8_everywhere, windows)
    assert perplexity(int8, windows[:2]) == perplexity(exact, windows[:2])  # the default scores prompts exactly
    print(f"\n[int8 activations perplexity] {NUM_WINDOWS} windows of {WINDOW} tokens: exact {base:.4f}, "
          f"int8 activations {ours:.4f} ({ours / base - 1:+.3%})")
    assert abs(ours / base - 1) < 0.01
