"""Tensor-parallel inference on 2 processes (gloo) against the same model in one process.

Greedy tokens must be identical to tp=1 (fp32; the all-reduces add partial sums in another
order, so logprobs agree to ~1e-6 and a near-tie, as in the parity suite, is the only excuse),
for each family: Llama (also in the preemption and chunked-prefill modes), Qwen2 (biases),
Qwen3 (q/k norms), Mixtral (experts split by intermediate width), and a tied-embedding Llama 3
whose vocabulary the ranks do not divide evenly (padded rows).
"""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from parity import PROMPTS, NEAR_TIE
from tiny_models import build_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)

CASES = {
    "llama": ("llama", {}, {}),
    "llama-preempt-swap-chunked": ("llama", {}, dict(num_kv_blocks=24, block_size=4, preemption_mode="swap",
                                                     swap_space=1 << 20, max_num_batched_tokens=24)),
    "qwen2": ("qwen2", {}, {}),
    "qwen3": ("qwen3", {}, {}),
    "mixtral": ("mixtral", {}, {}),
    "llama3-odd-vocab": ("llama3", {"vocab_size": 383}, {}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            arch, overrides, _ = CASES[name]
            built[name] = build_model(tmp_path_factory.mktemp(name), arch, tokenizer=False, **overrides)
        return built[name]

    return get


def generate(folder, **engine_args) -> tuple[list, LLM]:
    llm = LLM(str(folder), **engine_args)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return llm.generate(prompts, GREEDY, use_tqdm=False), llm


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_tokens_of_one(folders, case):
    _, _, engine_args = CASES[case]
    single, _ = generate(folders(case), **engine_args)
    split, llm = generate(folders(case), tensor_parallel_size=2, **engine_args)
    try:
        for one, two in zip(single, split):
            a, b = one.outputs[0], two.outputs[0]
            for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
                if x != y:  # only a near-tie may differ, and then the rest no longer compares
                    gap = abs(a.logprobs[i][x].logprob - a.logprobs[i].get(y, a.logprobs[i][x]).logprob)
                    assert y in a.logprobs[i] and gap < NEAR_TIE, f"position {i}: {x} vs {y}"
                    break
                assert abs(a.logprobs[i][x].logprob - b.logprobs[i][y].logprob) < 1e-4
        stats = llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        if "preempt" in case:
            assert stats["num_swap_outs"] > 0
    finally:
        llm.llm_engine.shutdown()


def test_a_worker_crash_fails_the_step_and_its_workers_go(folders):
    llm = LLM(str(folders("llama")), tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    [pid] = runner.worker_pids
    llm.llm_engine.add_request("0", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=64, ignore_eos=True))
    llm.llm_engine.step()
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        for _ in range(100):
            llm.llm_engine.step()
    assert time.monotonic() - started < 10, "a dead worker must fail the step, not hang it"
    llm.llm_engine.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_shutdown_stops_the_workers(folders):
    llm = LLM(str(folders("llama")), tensor_parallel_size=2)
    [pid] = llm.llm_engine.runner.worker_pids
    llm.llm_engine.shutdown()
    assert not psutil.pid_exists(pid)


def test_tensor_parallel_size_must_divide_the_heads(folders):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads=4"):
        LLM(str(folders("llama")), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="speculative_config is not supported"):
        LLM(str(folders("llama")), tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
