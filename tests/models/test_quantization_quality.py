"""Weight-only quantization of the tiny model, measured: int8 (per channel) and q4 (Q4_1 blocks
of 32, LM head Q8_0), perplexity on held-out text against fp32 (int8 within 1%) and greedy
agreement with fp32 over a fixed prompt set (printed in the test output).

The text is the default model's own validation split: standard-library files held out by the
trainer's stable per-document hash (`is_validation`, the config's validation_split of 0.02), so
the model never trained on it.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.training.corpus import iter_documents
from pagedllm.training.data import is_validation

TINY_MODEL = Path(__file__).resolve().parents[2] / "models" / "pagedllm-py-tiny"
VALIDATION_SPLIT = 0.02  # configs/pagedllm-py-tiny.toml
WINDOW, NUM_WINDOWS = 256, 24
NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 16, 24, 32
Q4_PERPLEXITY_COST = 0.02  # measured +0.75 %, 8 of 16 greedy completions identical to fp32


@pytest.fixture(scope="module")
def held_out():
    """Token windows and prompts from the held-out files, in a fixed order."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    windows, prompts = [], []
    for doc in iter_documents("@stdlib", "**/*.py"):
        if not is_validation(doc, VALIDATION_SPLIT):
            continue
        ids = tokenizer.encode(doc.text)
        if len(prompts) < NUM_PROMPTS and len(ids) > PROMPT_TOKENS:
            prompts.append(ids[:PROMPT_TOKENS])
        windows += [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)][:2]
        if len(prompts) == NUM_PROMPTS and len(windows) >= NUM_WINDOWS:
            return windows[:NUM_WINDOWS], prompts
    pytest.fail("the standard library has too few held-out files")


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    logprobs = [entry[token].logprob for out, w in zip(outputs, windows)
                for entry, token in zip(out.prompt_logprobs[1:], w[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_quantized_perplexity_and_greedy_agreement_with_fp32(held_out, capsys):
    windows, prompts = held_out
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    for name in ("fp32", "int8", "q4"):
        llm = LLM(str(TINY_MODEL), **({"quantization": name} if name != "fp32" else {}))
        completions = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
        results[name] = (perplexity(llm, windows), completions)
    ppl32, greedy32 = results["fp32"]
    identical = {}
    for name in ("int8", "q4"):
        ppl, completions = results[name]
        prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS) for x, y in zip(greedy32, completions)]
        identical[name] = sum(p == NEW_TOKENS for p in prefixes)
        matching = sum(a == b for x, y in zip(greedy32, completions) for a, b in zip(x, y)) / (NUM_PROMPTS * NEW_TOKENS)
        with capsys.disabled():
            print(f"\n[{name} quality] tiny model, {len(windows)} held-out windows of {WINDOW} tokens: perplexity fp32 {ppl32:.4f}, "
                  f"{name} {ppl:.4f} ({ppl / ppl32 - 1:+.2%}); greedy over {NUM_PROMPTS} prompts x {NEW_TOKENS} tokens: "
                  f"{identical[name]}/{NUM_PROMPTS} completions identical, mean agreeing prefix "
                  f"{sum(prefixes) / len(prefixes):.1f} tokens, {matching:.1%} of positions equal")
    assert abs(results["int8"][0] / ppl32 - 1) < 0.01 and identical["int8"] >= NUM_PROMPTS // 2
    assert abs(results["q4"][0] / ppl32 - 1) < Q4_PERPLEXITY_COST and identical["q4"] >= NUM_PROMPTS // 4
