"""Differential fuzz: random batches through the C path and the PyTorch path, equal tokens.

The C path is the engine as it runs by default on a CPU: the fused decode step (prompts that
fit one step laid out as its rows, multi-step bursts, speculative verification rows), the C
attention kernels and the C greedy sampler. The reference is the same engine without a
compiler: PyTorch modules, SDPA, torch's sampler, scheduling asynchronously (each step launched
before the last one's output is back, where the step allows it; the C path's fused step runs
synchronously), so the fuzz holds async scheduling to the synchronous engine too. Hypothesis draws the batches where the C
path's bookkeeping is thin — n and best_of up to 16 (more logit rows than rows: issue 28's
crash), beam search up to 10 beams (the widest the engine takes), prompts ending just before, at and after block boundaries
(forks copy-on-write a partly filled block, or share only full ones), prompts sharing prefixes
(prefix-cache hits), and engines that preempt by recompute and by swap, chunk prefills, speculate
with n-grams, run multi-step bursts or keep 4-bit weight blocks ("q4": the C path computes from the
blocks alone, the reference from their dequantized values).

Also run under AddressSanitizer + UBSan by tests/layers/test_sanitizers.py, where an
out-of-bounds access anywhere in the kernels ends the run with a report. Examples:
PAGEDLLM_FUZZ_EXAMPLES (default 30); the batches are derandomized, so a run is reproducible.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.llm_engine import MAX_LOGPROBS
from pagedllm.layers import kernels

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler: no C path to compare")

EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "30"))
MAX_SAMPLES = 16
MAX_BEAMS = MAX_LOGPROBS // 2  # each beam ranks 2 x width continuations, at most MAX_LOGPROBS
# Engines: (name, arguments). Block size 4 puts boundaries at every 4th prompt length.
ENGINES = {
    "defaults": dict(block_size=4),
    "block_size_1": dict(block_size=1),
    "block_size_16": dict(block_size=16),
    "prefix_caching": dict(block_size=4, enable_prefix_caching=True),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=8),
    "preempt_recompute": dict(block_size=4, num_kv_blocks=96, preemption_mode="recompute"),
    "preempt_swap": dict(block_size=4, num_kv_blocks=96, preemption_mode="swap", swap_space=4 << 20),
    "ngram": dict(block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
    "multi_step": dict(block_size=4, num_scheduler_steps=4),
    # kept 4-bit blocks (Q4_1 projections, a Q8_0 LM head): the C path reads only the blocks (the
    # fused step, and prefills through small_matmul's tiles), the reference their dequantized values
    "q4": dict(block_size=4, quantization="q4", int8_activations=False),  # exact: int8 activations are not
}
# Prompt lengths around the boundaries of 1-, 4- and 16-token blocks; every prompt is a prefix
# of one of two base sequences (prefix hits), one of them periodic (n-gram proposals).
LENGTHS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33)
BASES = ([3 + (5 * j) % 97 for j in range(40)], [7, 8, 9, 10] * 10)


@st.composite
def sampling(draw) -> SamplingParams:
    n = draw(st.integers(1, MAX_SAMPLES))
    best_of = draw(st.one_of(st.none(), st.integers(n, MAX_SAMPLES)))
    return SamplingParams(
        n=n, best_of=best_of, temperature=draw(st.sampled_from([0.0, 0.7, 1.0])), seed=draw(st.integers(0, 1000)),
        max_tokens=draw(st.integers(1, 6)), ignore_eos=True,
        logprobs=draw(st.one_of(st.none(), st.integers(0, 3))),
    )


@st.composite
def batches(draw, engines: tuple[str, ...] = tuple(sorted(ENGINES))) -> dict:
    prompts = draw(st.lists(st.tuples(st.sampled_from(BASES), st.sampled_from(LENGTHS)), min_size=1, max_size=4))
    beam = draw(st.one_of(st.none(), st.tuples(st.integers(1, MAX_BEAMS), st.integers(1, 5))))
    return {
        "engine": draw(st.sampled_from(engines)),
        "prompts": [base[:length] for base, length in prompts],
        "params": [draw(sampling()) for _ in prompts],
        "beam": beam,
    }


def run(folder: str, batch: dict, **engine_args) -> list:
    """Every completion's tokens (and every beam's) for the batch on a fresh engine."""
    llm = LLM(folder, **ENGINES[batch["engine"]], **engine_args)
    outputs = llm.generate(batch["prompts"], batch["params"], use_tqdm=False)
    tokens = [[c.token_ids for c in out.outputs] for out in outputs]
    if batch["beam"] is not None:
        width, max_tokens = batch["beam"]
        beams = llm.beam_search(batch["prompts"][:2], BeamSearchParams(beam_width=width, max_tokens=max_tokens))
        tokens.append([[seq.tokens for seq in out.sequences] for out in beams])
    return tokens


@pytest.fixture(scope="module")
def folder(model_dir) -> str:
    return str(model_dir("llama"))


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(batch=batches())
def test_the_c_path_and_the_torch_path_give_the_same_tokens(folder, monkeypatch, batch):
    compare(folder, monkeypatch, batch)


@settings(max_examples=max(2, EXAMPLES // 6), **SETTINGS)
@given(batch=batches(engines=("q4",)))
def test_kept_4_bit_blocks_give_the_tokens_of_their_dequantized_weights(folder, monkeypatch, batch):
    """Always a few batches on the q4 engine (the shared draw reaches it only now and then)."""
    compare(folder, monkeypatch, batch)


def compare(folder: str, monkeypatch, batch: dict) -> None:
    c_path = run(folder, batch)
    with monkeypatch.context() as patch:  # the engine as it runs without a compiler: no kernel at all
        patch.setattr(kernels, "compiler", lambda: None)
        patch.setattr(kernels, "_libraries", {})
        reference = run(folder, batch, attention_backend="sdpa", decode_backend="torch", async_scheduling=True)
    assert c_path == reference
