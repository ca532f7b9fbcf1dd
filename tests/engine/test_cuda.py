"""On a CUDA device: greedy tokens and logprobs against transformers on the same GPU, per
architecture, dtype and engine mode (`pytest -m cuda`; skipped where there is no GPU).

fp32 must agree exactly except at float near-ties, as on CPU. bf16 must agree except at bf16
near-ties: our kernels and transformers' round differently (fused projections, paged attention),
and bf16 keeps 8 bits of mantissa, so two logits closer than a few bf16 steps at the logits'
scale may swap; the gap is read from transformers' own bf16 logits, as the CPU suite does.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from parity import MAX_TOKENS, MODES, NEAR_TIE, PROMPTS, assert_mode_happened, assert_outputs_match
from tiny_models import load_reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
CUDA_MODES = ("defaults", "prefix_caching", "chunked_prefill", "preempt_recompute", "preempt_swap")
# (near-tie in logits, logprob tolerance) per dtype
TOLERANCES = {"float32": (NEAR_TIE, 1e-4), "bfloat16": (0.1, 0.1)}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def cuda_reference(model_dir):
    """(arch, dtype) -> [(greedy tokens, raw logits per step)] from transformers on the GPU."""
    cache = {}

    def get(arch: str, dtype: str):
        if (arch, dtype) not in cache:
            model = load_reference(model_dir(arch)).to("cuda", getattr(torch, dtype))
            model.generation_config.eos_token_id = None
            results = []
            with torch.inference_mode():
                for prompt in PROMPTS:
                    out = model.generate(
                        torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_TOKENS, do_sample=False,
                        output_logits=True, return_dict_in_generate=True, pad_token_id=2,
                    )
                    results.append((out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().cpu()))
            cache[(arch, dtype)] = results
        return cache[(arch, dtype)]

    return get


@pytest.mark.parametrize("mode", CUDA_MODES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_on_cuda(arch, dtype, mode, model_dir, cuda_reference):
    near_tie, logprob_tol = TOLERANCES[dtype]
    llm = LLM(str(model_dir(arch)), device="cuda", dtype=dtype, **MODES[mode])
    assert llm.llm_engine.device.type == "cuda" and not llm.llm_engine.runner.kernel_attention
    runs = 2 if mode == "prefix_caching" else 1  # the second run reuses the first one's blocks
    for _ in range(runs):
        assert_outputs_match(llm.generate(PROMPTS, GREEDY, use_tqdm=False), cuda_reference(arch, dtype), near_tie, logprob_tol)
    stats = llm.get_stats()
    assert_mode_happened(stats, mode)


def test_auto_dtype_on_cuda_is_half_precision(model_dir):
    llm = LLM(str(model_dir("llama")), device="cuda")
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert llm.llm_engine.runner.dtype is expected
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
