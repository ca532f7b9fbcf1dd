"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF), served from its file: greedy chat
answers equal transformers' on the same file (which dequantizes it to float32).

transformers' greedy tokens are checked by teacher forcing: one forward pass over prompt + our
answer, whose argmax at every position must be our next token. That is the same condition as
equal greedy generations (the first position where they differed would fail it) for one
forward pass instead of one per token."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import stdlib_text  # noqa: E402

from pagedllm import LLM, BeamSearchParams, SamplingParams  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Give me three tips for staying healthy.",
             "Write a Python function that reverses a string.", "Why is the sky blue?"]
NEW_TOKENS = 32
WINDOW, NUM_WINDOWS = 256, 8


@pytest.fixture(scope="module")
def llm(smollm2):
    """The exact path: the file's Q4_1 / Q8_0 blocks kept, read by the C kernels with fp32
    activations (the default quantizes activations to int8, test_smollm2_int8_activations.py)."""
    return LLM(str(smollm2), kv_cache_memory=64 << 20, int8_activations=False)


@pytest.fixture(scope="module")
def reference(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32).eval()


def chat(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_greedy_chat_tokens_equal_transformers(llm, reference):
    tokenizer = llm.get_tokenizer()
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                           use_tqdm=False)
    agree = []
    for prompt, output in zip(prompts, outputs):
        ours = output.outputs[0].token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        ref = logits.argmax(-1).tolist()
        assert ours == ref, f"first difference at answer token {next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)}: " \
                            f"{tokenizer.decode(ours)!r}"
        agree.append(len(ours))
    print(f"\n[smollm2 parity] greedy tokens equal transformers' on {len(agree)} chat prompts: {agree} tokens each")
    assert tokenizer.decode(outputs[0].outputs[0].token_ids, skip_special_tokens=True) == "The capital of France is Paris."


def greedy_agreement(base: LLM, other: LLM) -> tuple[int, int, list[list[int]], list[int]]:
    """`other` against `base` on the chat questions, for an engine that is not exact: teacher-forced
    on base's greedy answers, at how many of their positions other's own greedy choice (its top
    prompt logprob) is base's next token; other's free greedy answers; and for how many tokens
    each equals base's. Returns (agree, total, other's answers, equal prefix lengths)."""
    prompts = [chat(base.get_tokenizer(), q) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    answers = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    ours = [o.outputs[0].token_ids for o in other.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    forced = other.generate([{"prompt_token_ids": p + a} for p, a in zip(prompts, answers)],
                            SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree = total = 0
    for prompt, answer, out in zip(prompts, answers, forced):
        for token, entry in zip(answer, out.prompt_logprobs[len(prompt):]):
            agree += max(entry.items(), key=lambda item: item[1].logprob)[0] == token
            total += 1
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(answers, ours)]
    return agree, total, ours, same


def text_windows(llm: LLM) -> list[list[int]]:
    """NUM_WINDOWS windows of WINDOW tokens of standard-library text: the perplexity tests' corpus."""
    ids = llm.get_tokenizer()(stdlib_text(60_000)).input_ids
    return [ids[i : i + WINDOW] for i in range(0, WINDOW * NUM_WINDOWS, WINDOW)]


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)
    logprobs = [entry[token].logprob for out, w in zip(outputs, windows) for entry, token in zip(out.prompt_logprobs[1:], w[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_kept_blocks_perplexity_equals_the_dequantized_path(llm, smollm2):
    """The kept Q4_1 / Q8_0 blocks are the file's weights: perplexity as with every weight
    dequantized to fp32 (only summation order differs), on standard-library text."""
    windows = text_windows(llm)
    kept = perplexity(llm, windows)
    dense = perplexity(LLM(str(smollm2), kv_cache_memory=64 << 20, quantization="none"), windows)
    print(f"\n[smollm2 perplexity] {NUM_WINDOWS} windows of {WINDOW} tokens: kept Q4_1/Q8_0 blocks {kept:.4f}, "
          f"dequantized fp32 {dense:.4f} ({kept / dense - 1:+.3%})")
    assert abs(kept / dense - 1) < 1e-3


def test_prefix_cache_beam_search_and_ngram_speculation(llm, smollm2):
    """The engine's features on the GGUF model: a repeated chat prompt is found in the prefix
    cache with the same greedy answer; beam search returns its best beams; n-gram speculation
    gives the plain engine's greedy tokens."""
    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": chat(tokenizer, "List the days of the week, then list them again in the same order.")}
    greedy = SamplingParams(temperature=0, max_tokens=48)
    first = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    hits = llm.get_stats()["prefix_cache_hits"]
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.get_stats()["prefix_cache_hits"] > hits

    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=12))[0].sequences
    assert len(beams) == 3 and beams[0].score >= beams[-1].score

    speculative = LLM(str(smollm2), kv_cache_memory=64 << 20, int8_activations=False,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert speculative.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == first
    assert speculative.get_stats()["spec_decode_num_accepted_tokens"] > 0
