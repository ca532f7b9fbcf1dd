"""kv_cache_dtype="bfloat16" or "float16": refused where the pool's readers are not the C
attention kernels, and, on a tiny model, the engine modes that move or share blocks — swapping out
and in, the prefix cache — give the half pool engine's own tokens (they copy or reuse its blocks as
they are).
Quality on a real model: tests/gguf/test_smollm2_kv_half.py; the kernels: tests/layers/test_kv_half_pools.py."""
from __future__ import annotations

import argparse

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.engine_args import add_engine_arguments, engine_args
from pagedllm.layers import kernels
from parity import MAX_TOKENS, MODES, PROMPTS, assert_mode_happened

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler: no C attention kernels")
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


NGRAM = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["preempt_swap", "prefix_caching", "preempt_recompute", "ngram"])
def test_modes_that_move_or_share_blocks_keep_the_half_pool_engines_tokens(mode, kv, model_dir):
    """(n-gram speculation too: its verification rows read the half pool like decodes.)"""
    folder = str(model_dir("llama"))
    expected = tokens(LLM(folder, kv_cache_dtype=kv))
    llm = LLM(folder, kv_cache_dtype=kv, **(NGRAM if mode == "ngram" else MODES[mode]))
    assert llm.llm_engine.runner.kv_cache.k.dtype == getattr(torch, kv)
    for _ in range(2 if mode == "prefix_caching" else 1):
        assert tokens(llm) == expected
    if mode != "ngram":
        assert_mode_happened(llm.get_stats(), mode)


@pytest.mark.parametrize("args, match", [
    (dict(attention_backend="sdpa"), "C attention kernels"),
    (dict(kv_offload=True), "kv_offload"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of"),
])
@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_what_cannot_read_a_half_pool_is_refused(kv, args, match, model_dir):
    with pytest.raises(ValueError, match=match):
        LLM(str(model_dir("llama")), **{"kv_cache_dtype": kv, **args})


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_draft_model_is_refused(kv, model_dir):
    folder = str(model_dir("llama"))
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{kv}' is not supported with a draft model"):
        LLM(folder, kv_cache_dtype=kv, speculative_config={"model": folder, "num_speculative_tokens": 2})


def test_the_cli_flag():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args(parser.parse_args(["--kv-cache-dtype", "bfloat16"]))["kv_cache_dtype"] == "bfloat16"
    assert engine_args(parser.parse_args(["--kv-cache-dtype", "float16"]))["kv_cache_dtype"] == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])
