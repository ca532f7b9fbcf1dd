"""Incremental detokenization decodes through the Rust tokenizer directly when that gives
transformers' text, and through transformers otherwise."""
from __future__ import annotations

import copy
import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.detokenizer import Detokenizer
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.paths import TINY_MODEL


def windows(tokenizer, count: int = 300) -> list[list[int]]:
    """Random windows of ids, some with special tokens (which skip_special_tokens drops)."""
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    out = []
    for _ in range(count):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        if special and rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        out.append(ids)
    return out


def test_the_direct_decode_is_transformers_text():
    tokenizer = load_tokenizer(str(TINY_MODEL))
    assert tokenizer.clean_up_tokenization_spaces is False
    reference = [(ids, skip, tokenizer.decode(ids, skip_special_tokens=skip)) for ids in windows(tokenizer) for skip in (True, False)]
    single = {t: tokenizer.decode([t]) for t in range(0, len(tokenizer), 97)}
    detokenizer = Detokenizer(tokenizer)

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' decode was called")

    tokenizer.decode = refuse  # the direct path never goes through it
    assert all(detokenizer._decode(ids, skip) == text for ids, skip, text in reference)
    assert all(detokenizer.decode_token(t) == text for t, text in single.items())  # logprob entries' tokens


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    tokenizer = copy.deepcopy(load_tokenizer(str(TINY_MODEL)))
    tokenizer.clean_up_tokenization_spaces = True
    calls = []
    original = tokenizer.decode

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    tokenizer.decode = counted
    detokenizer = Detokenizer(tokenizer)
    ids = windows(tokenizer, 1)[0]
    assert detokenizer._decode(ids, True) == original(ids, skip_special_tokens=True) and calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_streamed_text_is_the_decoded_tokens(temperature):
    """The default model's completions: the text the engine built token by token equals
    transformers' decode of the prompt and completion, less the prompt's own text."""
    llm = LLM(str(TINY_MODEL))
    tokenizer = load_tokenizer(str(TINY_MODEL))
    prompts = ["def parse(args):\n    ", "import os\nimport sys\n\n", "class Point:\n    def __init__(self, x, y):\n"]
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=48, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        ids = list(out.prompt_token_ids)
        full = tokenizer.decode(ids + list(out.outputs[0].token_ids), skip_special_tokens=True)
        assert full == tokenizer.decode(ids, skip_special_tokens=True) + out.outputs[0].text
