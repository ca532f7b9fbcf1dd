"""The real default model (SmolLM2-135M-Instruct, Q4_1 / Q8_0 blocks) as it runs by default:
int8 activations (engine argument int8_activations, on by default for block-quantized weights)
in every step, prompts included — every block-quantized matmul multiplies activations quantized
to int8 per block of 32, llama.cpp's way (csrc/small_matmul.c) — with a prompt's bits independent
of how it was split or cached (its chunks never take the fused decode step's own arithmetic). Not
exact, so against the exact path (teacher-forced greedy agreement, perplexity)."""
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
def int8_chunked(smollm2):
    """The default, its prompts cut into chunks of 16 positions and no prefix cache."""
    return LLM(str(smollm2), kv_cache_memory=64 << 20, enable_prefix_caching=False, enable_chunked_prefill=True,
               max_num_batched_tokens=16)


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


def first_logprobs(llm, prompt: list[int], cached: int | None = 0) -> dict[int, float]:
    scored = SamplingParams(max_tokens=1, logprobs=5, temperature=0)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], scored, use_tqdm=False)
    assert cached is None or output.num_cached_tokens == cached
    (got,) = output.outputs[0].logprobs
    return {token: entry.logprob for token, entry in got.items()}


@pytest.mark.parametrize("question", QUESTIONS[:3])
def test_prompts_take_int8_and_their_bits_do_not_depend_on_the_split(exact, int8, int8_chunked, question):
    """A prompt's first-token logprobs are bit-identical whole, as a prefix-cache hit (32 cached
    positions, a tail of 5-8 that fits one fused step) and in chunks of 16 — and are not the exact
    path's: its steps took int8 too. Before prompt chunks were kept off the fused decode step the
    three differed by 0.15-0.20 nats, and this near-tie (0.08 nats) flipped the repeated question
    "What is the capital of France?" to a wrong answer."""
    prompt = chat(exact.get_tokenizer(), question)
    assert int8.reset_prefix_cache()
    whole = first_logprobs(int8, prompt)
    assert first_logprobs(int8, prompt, cached=32) == whole  # the second finds two blocks in the prefix cache
    assert first_logprobs(int8_chunked, prompt) == whole
    want = first_logprobs(exact, prompt, cached=None)
    assert list(whole)[:2] == list(want)[:2] and whole != want
    assert max(abs(whole[t] - want[t]) for t in want if t in whole) < 0.2
    assert int8.llm_engine.runner._int8_now is True and int8.llm_engine.runner.model.fused._lm_head.int8_activations == 1


def test_embeddings_pool_fp32_and_steps_after_them_take_int8_again(exact, int8):
    """Pooled embeddings score no token and keep fp32 activations: the default engine's equal the
    exact path's; the steps after them multiply int8 activations again."""
    prompt = {"prompt_token_ids": chat(exact.get_tokenizer(), QUESTIONS[1])}
    (ours,), (want,) = int8.embed([prompt]), exact.embed([prompt])
    assert ours.outputs.embedding == want.outputs.embedding
    runner = int8.llm_engine.runner
    assert runner._int8_now is True and runner.model.fused._lm_head.int8_activations == 1
    int8.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert runner._int8_now is True


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
