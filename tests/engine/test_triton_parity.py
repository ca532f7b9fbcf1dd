"""The engine on the Triton attention kernels (the GPU path) against transformers, in every engine
mode: greedy tokens and logprobs, the near-tie rule of tests/parity.py. Without a GPU the kernels
run in Triton's interpreter on the CPU (tests/conftest.py), so this suite guards the GPU path on
every commit; `pytest -m cuda` runs tests/engine/test_cuda.py, where Triton is the CUDA default.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.layers import triton_attention
from parity import MAX_TOKENS, MODES, PROMPTS, assert_mode_happened, assert_outputs_match

pytestmark = pytest.mark.skipif(triton_attention.triton is None, reason="Triton is not installed")

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
# The modes that give the kernels something the others do not: prefix caching (a prefill after a
# cached prefix; its first run is the defaults', which enable caching and chunking) and chunked
# prefill (chunks over the chunk before). Block sizes 1 to 32 and shuffled block tables are the
# kernels' unit tests' (tests/layers/test_triton_attention.py); preemption and swapping change which
# blocks a table names, not what the kernels do with it, and run with every other backend in
# tests/engine/test_greedy_parity.py (and natively on CUDA in tests/engine/test_cuda.py).
TRITON_MODES = ["prefix_caching", "chunked_prefill"]


def run_and_check(llm: LLM, expected, mode: str) -> None:
    runs = 2 if mode == "prefix_caching" else 1  # the second run reuses the first one's blocks
    for _ in range(runs):
        assert_outputs_match(llm.generate(PROMPTS, GREEDY, use_tqdm=False), expected)
    assert_mode_happened(llm.get_stats(), mode)


@pytest.mark.parametrize("mode", TRITON_MODES)
def test_triton_backend_matches_transformers(mode, model_dir, reference):
    llm = LLM(str(model_dir("llama")), attention_backend="triton", **MODES[mode])
    assert llm.llm_engine.runner.attention_backend == "triton" and llm.llm_engine.runner.model.fused is None
    run_and_check(llm, reference("llama"), mode)


def test_triton_backend_sliding_window(model_dir, reference):
    llm = LLM(str(model_dir("mistral")), attention_backend="triton", **MODES["chunked_prefill"])
    run_and_check(llm, reference("mistral"), "chunked_prefill")


def test_triton_element_wise_ops_in_the_model(model_dir, reference):
    """RMSNorm (q/k norms too), rotary and SiLU-up as Triton kernels, which the runner turns on
    with the Triton backend on CUDA, here through the interpreter on a Qwen3 (another head_dim)."""
    llm = LLM(str(model_dir("qwen3")), attention_backend="triton")
    assert not llm.llm_engine.runner.model.model.norm.triton  # a CPU runner leaves them off
    llm.llm_engine.runner.model.use_triton_ops()
    run_and_check(llm, reference("qwen3"), "defaults")
