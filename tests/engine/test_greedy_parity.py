"""Acceptance: greedy tokens identical to transformers (fp32) in every engine mode, per arch.

A difference is accepted only where transformers' own logits for our token and its token are
within 1e-3 (a float near-tie); after such a divergence the trajectories no longer compare.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.paged_decode import compiler
from parity import MAX_TOKENS, MODES, PROMPTS, assert_mode_happened, assert_outputs_match
from tiny_models import load_reference

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", *MOE_ARCHS)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)



@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, mode, model_dir, reference):
    llm = LLM(str(model_dir(arch)), **MODES[mode])
    # Both decode-attention backends face the reference: the C kernel (fp32 on a CPU with a C
    # compiler, the default) and SDPA over gathered blocks (other devices and dtypes, fallback).
    assert llm.llm_engine.runner.kernel_attention == (mode != "sdpa_decode" and compiler() is not None)
    # Small all-decode steps of dense models run as one fused C call wherever the C attention
    # kernel does (models/fused_decode.py); the modules (the sdpa_decode mode, MoE models) stay
    # under test as well.
    dense = arch not in MOE_ARCHS
    assert (llm.llm_engine.runner.model.fused is not None) == (llm.llm_engine.runner.kernel_attention and dense)
    runs = 2 if mode == "prefix_caching" else 1  # the second run reuses the first one's blocks
    for _ in range(runs):
        assert_outputs_match(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference(arch))
    stats = llm.get_stats()
    assert_mode_happened(stats, mode)


def test_mixed_steps_happen_with_chunked_prefill(model_dir):
    """A step can carry prefill chunks and decodes together, within the token budget."""
    llm = LLM(str(model_dir("llama")), max_num_batched_tokens=32)
    engine = llm.llm_engine
    engine.add_request("short", PROMPTS[4], GREEDY)  # decodes while the long prompt prefills
    engine.add_request("long", PROMPTS[-1], GREEDY)
    seen_mixed = False
    original = engine.runner.execute

    def spy(sched):
        nonlocal seen_mixed
        assert sched.num_batched_tokens <= 32
        kinds = {chunk.num_tokens > 1 for chunk in sched.chunks}
        seen_mixed |= kinds == {True, False}
        return original(sched)

    engine.runner.execute = spy
    while engine.has_unfinished_requests():
        engine.step()
    assert seen_mixed


def test_prompt_logprobs_match_transformers(model_dir):
    folder = model_dir("qwen3")
    model = load_reference(folder)
    prompt = PROMPTS[3]
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for kwargs in ({}, dict(max_num_batched_tokens=16)):
        llm = LLM(str(folder), **kwargs)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            entry = out.prompt_logprobs[position]
            assert abs(entry[prompt[position]].logprob - float(expected[position - 1, prompt[position]])) < 1e-4
            assert len(entry) >= 2 and any(lp.rank == 1 for lp in entry.values())
