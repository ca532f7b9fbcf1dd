"""Layer-wise KV offload: a context larger than the device KV budget runs, token-identical to
transformers, with the pool in host memory and two layers' buffers on the device."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.worker.kv_cache import bytes_per_block
from parity import assert_matches
from tiny_models import build_model, load_reference

BLOCK = 16
RNG = random.Random(7)
PROMPTS = [[RNG.randrange(3, 380) for _ in range(n)] for n in (300, 40, 170, 95)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """Six layers, so two layers' buffers are a third of the resident pool's footprint."""
    folder = build_model(tmp_path_factory.mktemp("six-layers"), "llama", num_hidden_layers=6, tokenizer=False)
    model = load_reference(folder)
    model.generation_config.eos_token_id = None
    reference = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=2,
                                 output_logits=True, return_dict_in_generate=True)
            reference.append((out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)))
    return folder, reference


def device_budget(folder, blocks: int) -> int:
    """Bytes of `blocks` whole blocks (all layers): what a resident pool of that size needs."""
    return blocks * bytes_per_block(ModelConfig.from_pretrained(folder), BLOCK, torch.float32)


MODES = {
    "kernel_attention": {},
    "sdpa_decode": dict(attention_backend="sdpa"),
    "chunked_prefill_and_prefix_cache": dict(max_num_batched_tokens=64, enable_prefix_caching=True),
    "small_host_pool_recompute": dict(num_kv_blocks=22),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_context_larger_than_the_device_budget_runs_and_matches_transformers(six_layers, mode):
    folder, reference = six_layers
    budget = device_budget(folder, 8)  # 128 tokens if resident; the longest prompt has 300
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        LLM(str(folder), kv_cache_memory=budget, block_size=BLOCK).generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    engine_args = {"num_kv_blocks": 96, **MODES[mode]}
    llm = LLM(str(folder), kv_offload=True, kv_offload_device_memory=budget, block_size=BLOCK, **engine_args)
    assert llm.llm_engine.runner.max_step_blocks == min(24, engine_args["num_kv_blocks"])  # 8 blocks x 6 layers, as two layers' buffers
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for output, (tokens, logits) in zip(outputs, reference):
        assert assert_matches(output.outputs[0].token_ids, tokens, logits) == len(tokens)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if mode == "small_host_pool_recompute":
        assert stats["num_preemptions"] > 0


def test_a_prompt_larger_than_the_buffer_is_rejected_up_front(six_layers):
    folder, _ = six_layers
    llm = LLM(str(folder), kv_offload=True, kv_offload_device_memory=device_budget(folder, 4), block_size=BLOCK)
    with pytest.raises(ValueError, match=r"more than the whole KV cache holds \(192 tokens in 12 blocks\)"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("args, message", [
    (dict(preemption_mode="swap"), "kv_offload is not supported with preemption_mode='swap'"),
    (dict(tensor_parallel_size=2), "kv_offload is not supported with tensor_parallel_size > 1"),
    (dict(kv_offload_device_memory=100), "holds no block of two layers"),
])
def test_offload_rejects_what_it_cannot_do(six_layers, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(six_layers[0]), kv_offload=True, **args)


def test_forked_samples_copy_on_write_in_the_host_pool(six_layers):
    """n > 1 forks share the prompt's partly filled block; its copy-on-write happens in the host
    pool, and the samples equal the resident engine's (same seeds, same arithmetic)."""
    folder, _ = six_layers
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[2]}  # 170 tokens: the last block is partly filled
    resident = LLM(str(folder), block_size=BLOCK).generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(str(folder), block_size=BLOCK, kv_offload=True, kv_offload_device_memory=device_budget(folder, 8))
    offloaded = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in offloaded.outputs] == [c.token_ids for c in resident.outputs]
    assert len({tuple(c.token_ids) for c in offloaded.outputs}) > 1
