"""The tokenizer and chat template built from a GGUF's metadata behave like transformers' GGUF
tokenizer on the same file (SmolLM2-135M-Instruct's 49,152-token byte-level BPE).

One documented difference: the file's `tokenizer.ggml.pre` is "smollm", for which llama.cpp cuts
every digit apart before the GPT-2 split (as SmolLM2's own tokenizer.json does with its Digits
pre-tokenizer); transformers' GGUF loader knows no "smollm" and uses the GPT-2 split alone. The
vocabulary has no multi-digit token, so the two differ only where whitespace runs into a digit:
GPT-2's split gives the last space to the digit (" 0" -> "Ġ", "0" after the other spaces), the
digit split leaves the whole run of spaces together. Every other line must tokenize the same.
"""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import stdlib_text  # noqa: E402

from pagedllm.engine.llm_engine import load_tokenizer  # noqa: E402

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
EXTRA = ["In 2024, 12,345 people paid $3.50 each (€2.99).", "naïve café — 東京 🚀 Привет мир", "  leading\tand trailing  ",
         "", "\n\n\n", "x" * 300, "don't won't I'll we've they're", "<|im_start|>", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    from transformers import AutoTokenizer

    return load_tokenizer(str(smollm2)), AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


def lines() -> list[str]:
    """~3,000 lines: standard-library source, some with special tokens spliced in, and odd cases."""
    rng = random.Random(0)
    source = [line for line in stdlib_text(200_000).splitlines() if line.strip()][:2800]
    spliced = [line[: len(line) // 2] + rng.choice(SPECIALS) + line[len(line) // 2 :] for line in source[::14]]
    return source + spliced + EXTRA


SPACE_THEN_DIGIT = re.compile(r"\s\d")


def test_encode_and_decode_like_transformers(tokenizers):
    ours, ref = tokenizers
    texts = lines()
    assert len(texts) > 2900
    our_ids, ref_ids = ours(texts)["input_ids"], ref(texts)["input_ids"]
    differ = [i for i, (a, b) in enumerate(zip(our_ids, ref_ids)) if a != b]
    unexplained = [texts[i] for i in differ if not SPACE_THEN_DIGIT.search(texts[i])]
    assert not unexplained, f"{len(unexplained)} lines tokenize differently, e.g. {unexplained[:3]}"
    print(f"\n[gguf tokenizer] {len(texts)} lines: {len(texts) - len(differ)} tokenize as transformers' GGUF tokenizer; "
          f"{len(differ)} differ only where whitespace meets a digit (llama.cpp's 'smollm' digit split)")
    assert len(differ) < 0.02 * len(texts)
    for i in differ:  # there, every digit is a token of its own and no space token carries a digit
        tokens = ours.convert_ids_to_tokens(our_ids[i])
        assert all(not any(c.isdigit() for c in t) or len(t) == 1 for t in tokens)
    assert any(ours.convert_tokens_to_ids("<|im_start|>") in ids for ids in our_ids)  # special tokens stay whole
    for skip in (False, True):
        assert ours.batch_decode(our_ids, skip_special_tokens=skip) == ref.batch_decode(ref_ids, skip_special_tokens=skip)


def test_special_tokens_and_ids(tokenizers):
    ours, ref = tokenizers
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.unk_token, ref.pad_token)
    assert ours.eos_token_id == 2 and ours.all_special_tokens == ref.all_special_tokens and len(ours) == len(ref) == 49152
    assert ours("hello").input_ids == ref("hello").input_ids  # no BOS: the file says add_bos_token = false


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about rain."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tokenizers, messages, add_generation_prompt):
    ours, ref = tokenizers
    args = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.chat_template == ref.chat_template
    assert ours.apply_chat_template(messages, **args) == ref.apply_chat_template(messages, **args)
