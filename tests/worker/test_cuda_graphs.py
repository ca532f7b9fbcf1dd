"""CUDA graphs for decode steps: the ladder of captured sizes, padding a step to the next size,
and the runner's graph path (static buffers, padding rows, sampled rows picked from the padded
batch) against transformers. On a CPU the same path runs with the forward pass eager over the
static buffers (nothing can be captured there); under `pytest -m cuda` the graphs are captured
and replayed for real.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers import triton_attention
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from parity import MAX_TOKENS, NEAR_TIE, PROMPTS, assert_outputs_match

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
needs_triton = pytest.mark.skipif(triton_attention.triton is None, reason="Triton is not installed")
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_capture_sizes_ladder():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(1) == [1]


def test_padded_size_is_the_next_captured_size():
    sizes = capture_sizes(20)  # 1, 2, 4, 8, 16, 20
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert padded_size(21, sizes) is None


@needs_triton
def test_padded_graph_path_matches_transformers_on_cpu(model_dir, reference):
    """Nine sequences decode as batches padded to 16 rows (slot -1, empty contexts): the rows that
    sample must come out as transformers' tokens, and the padding must not touch the KV pool."""
    llm = LLM(str(model_dir("llama")), attention_backend="triton")
    runner = llm.llm_engine.runner
    assert runner.graphs is None  # nothing is captured on a CPU
    runner.graphs = DecodeGraphs(runner.model, [1, 2, 4, 16], -(-runner.max_model_len // runner.block_size), runner.device)
    assert_outputs_match(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference("llama"))
    assert runner.graphs.num_replays >= MAX_TOKENS - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_num_seqs", [5, 256])  # batches of 9 beyond the largest size run eagerly
def test_cuda_graphs_capture_and_replay(dtype, max_num_seqs, model_dir, reference, request):
    for mark in needs_cuda:
        request.applymarker(mark)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    llm = LLM(str(model_dir("llama")), device="cuda", dtype=dtype, max_num_seqs=max_num_seqs)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == capture_sizes(max_num_seqs)
    ours = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert graphs.num_replays > 0
    # transformers on the CPU as the reference: float32 to GPU rounding, bf16 to its near-ties
    near_tie, logprob_tol = {"float32": (NEAR_TIE, 1e-3), "bfloat16": (0.1, 0.1)}[dtype]
    assert_outputs_match(ours, reference("llama"), near_tie, logprob_tol)
    eager = LLM(str(model_dir("llama")), device="cuda", dtype=dtype, max_num_seqs=max_num_seqs, enforce_eager=True)
    assert eager.llm_engine.runner.graphs is None
