"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF), served from its file: greedy chat
answers equal transformers' on the same file (which dequantizes it to float32).

transformers' greedy tokens are checked by teacher forcing: one forward pass over prompt + our
answer, whose argmax at every position must be our next token. That is the same condition as
equal greedy generations (the first position where they differed would fail it) for one
forward pass instead of one per token."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Give me three tips for staying healthy.",
             "Write a Python function that reverses a string.", "Why is the sky blue?"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(str(smollm2), kv_cache_memory=64 << 20, quantization=None)


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
