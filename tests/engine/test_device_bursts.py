"""Multi-step scheduling without the fused C step (the GPU's way, worker/model_runner.py
_device_greedy_steps): a burst's passes run back to back on the device, each step's argmax
written into the next step's input ids there, positions, context lengths and slots advanced
there, the tokens fetched once. Checked on the CPU through the modules with the C attention
kernels, through the Triton kernels in Triton's interpreter, and through the CUDA-graph runner
(padded batches, replayed eagerly on a CPU): greedy tokens equal transformers' and the
single-step engine's, bursts happen, stop rules cut them where single steps stop."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers import kernels, triton_attention
from pagedllm.worker.cuda_graphs import DecodeGraphs
from pagedllm.worker.model_runner import ModelRunner
from parity import MAX_TOKENS, MODES, PROMPTS, assert_mode_happened, assert_outputs_match

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
needs_cc = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler: no C attention kernels")
needs_triton = pytest.mark.skipif(triton_attention.triton is None, reason="Triton is not installed")


@pytest.fixture
def bursts(monkeypatch):
    """The step count of every device burst run during the test."""
    seen: list[int] = []
    original = ModelRunner._device_greedy_steps

    def counted(self, *args):
        seen.append(args[-1])
        return original(self, *args)

    monkeypatch.setattr(ModelRunner, "_device_greedy_steps", counted)
    return seen


def check(llm: LLM, expected, mode: str, bursts: list[int]) -> None:
    assert llm.llm_engine.runner.model.fused is None  # not the fused C step's bursts
    runs = 2 if mode == "prefix_caching" else 1
    for _ in range(runs):
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_outputs_match(outputs, expected)
        for completion in (output.outputs[0] for output in outputs):
            assert all(step[token].rank == 1 for step, token in zip(completion.logprobs, completion.token_ids))
    assert_mode_happened(llm.get_stats(), mode)
    assert bursts and max(bursts) == 4 and all(1 < n <= 4 for n in bursts)


@needs_cc
@pytest.mark.parametrize("mode", ["defaults", "prefix_caching", "preempt_recompute", "block_size_1"])
def test_device_bursts_through_the_modules_match_transformers(mode, model_dir, reference, bursts):
    llm = LLM(str(model_dir("llama")), num_scheduler_steps=4, decode_backend="torch", **MODES[mode])
    check(llm, reference("llama"), mode, bursts)


@needs_cc
def test_device_bursts_with_a_sliding_window(model_dir, reference, bursts):
    llm = LLM(str(model_dir("mistral")), num_scheduler_steps=4, decode_backend="torch")
    check(llm, reference("mistral"), "defaults", bursts)


@needs_triton
def test_device_bursts_through_the_triton_kernels_and_padded_graph_batches(model_dir, reference, bursts):
    """Nine sequences in batches padded to 16 rows, as a CUDA graph takes them: the padding rows
    must stay put while the real rows advance."""
    llm = LLM(str(model_dir("llama")), attention_backend="triton", num_scheduler_steps=4)
    runner = llm.llm_engine.runner
    runner.graphs = DecodeGraphs(runner.model, [1, 2, 4, 16], -(-runner.max_model_len // runner.block_size), runner.device)
    check(llm, reference("llama"), "defaults", bursts)
    assert runner.graphs.num_replays >= MAX_TOKENS - 1


@needs_cc
def test_stop_rules_cut_a_device_burst_where_single_steps_stop(model_dir, bursts):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    stop_at = SamplingParams(temperature=0, max_tokens=12)
    outputs = []
    for steps in (1, 4):
        llm = LLM(str(model_dir("llama")), num_scheduler_steps=steps, decode_backend="torch")
        plain = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        first = plain[0].outputs[0].token_ids
        stopped = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first[1]]),
                               use_tqdm=False)
        eos = llm.generate(PROMPTS[:2], stop_at, use_tqdm=False)
        outputs.append([[o.outputs[0].token_ids for o in batch] for batch in (plain, stopped, eos)])
    assert outputs[0] == outputs[1]
    assert [len(t) for t in outputs[1][0]] == [3, 6, 9]
    assert bursts


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_bursts_replay_captured_graphs_on_cuda(model_dir, bursts):
    """On a GPU (`pytest -m cuda`): bursts of replayed CUDA graphs give the single-step engine's
    greedy tokens (float32, the same kernels either way)."""
    outputs = []
    for steps in (1, 4):
        llm = LLM(str(model_dir("llama")), device="cuda", num_scheduler_steps=steps)
        assert llm.llm_engine.runner.graphs is not None
        outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
    assert outputs[0] == outputs[1] and bursts and max(bursts) == 4
