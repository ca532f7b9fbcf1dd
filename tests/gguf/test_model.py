"""A GGUF file served directly gives transformers' greedy tokens on the same file.

transformers reads the file with its own GGUF loader and dequantizer (from_pretrained(dir,
gguf_file=...)), so names, the q/k permutation, the hyper-parameters and every tensor type are
checked against an implementation that is not ours. Tiny random models (tests/gguf_files.py);
the real model is tests/gguf/test_smollm2.py. With the blocks kept (the default for GGUF files),
decode steps of up to 16 rows run the fused C step on Q4/Q8_0 panels and prefills the modules.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.gguf import open_gguf
from pagedllm.gguf.weights import tensors as gguf_tensors
from pagedllm.layers.quantization import KEPT_TYPES

PROMPTS = [[5, 17, 99, 200, 31, 7, 8, 9], [100, 101, 102, 3, 4], list(range(40, 75))]
NEW_TOKENS = 12
CASES = [("llama", t) for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")] + [
    ("qwen2", "F32"), ("qwen2", "Q4_0"), ("qwen2", "Q4_K"), ("qwen3", "F32"), ("qwen3", "Q8_0")]


def reference_tokens(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def engine_tokens(path, **engine_args) -> list[list[int]]:
    llm = LLM(str(path), kv_cache_memory=16 << 20, **{"int8_activations": False, **engine_args})  # the exact path
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch,weight_type", CASES)
def test_greedy_tokens_equal_transformers(tiny_gguf, arch, weight_type):
    """Dequantized ("none"), and for Q4_0 / Q4_1 / Q8_0 also with the blocks kept (the default):
    the kept blocks are the same weights, read by the C kernels."""
    path = tiny_gguf(arch, weight_type)
    reference = reference_tokens(path)
    assert engine_tokens(path, quantization="none") == reference
    if weight_type in KEPT_TYPES:
        assert engine_tokens(path) == reference


def test_mixed_types_as_llama_cpp_writes_them(tiny_gguf):
    """A Q4_1 file with a Q8_0 embedding and an F16 output head (and F32 norms), blocks kept."""
    path = tiny_gguf("llama", "Q4_1", **{"token_embd.weight": "Q8_0", "output.weight": "F16"})
    assert engine_tokens(path) == reference_tokens(path)


@pytest.mark.parametrize("weight_type, kept", [("Q4_K", "Q4_1"), ("Q6_K", "Q8_0")])
def test_k_quants_are_converted_to_the_nearest_kept_type(tiny_gguf, weight_type, kept):
    """K-quant matrices become Q4_1 / Q8_0 blocks at load; each weight moves by at most the kept
    type's rounding (half a step of its block's scale, plus the fp16 rounding of scale and min)."""
    path = tiny_gguf("llama", weight_type)
    llm = LLM(str(path), kv_cache_memory=16 << 20)
    model = llm.llm_engine.runner.model
    assert {linear.blocks.kind for linear in model.linears()} == {kept}
    original = dict(gguf_tensors(open_gguf(path)))
    attn = model.model.layers[0].self_attn.qkv_proj
    q_rows = attn.shard_sizes[0]
    before = original["model.layers.0.self_attn.q_proj.weight"]
    after = attn.blocks.dequantize()[:q_rows]
    blocks = before.view(before.shape[0], -1, 32)
    spread = blocks.amax(-1) - blocks.amin(-1) if kept == "Q4_1" else 2 * blocks.abs().amax(-1)
    step = spread / (15 if kept == "Q4_1" else 254)
    fp16 = blocks.abs().amax(-1) * 2.0**-10  # the fp16 rounding of a block's scale and min
    assert ((after - before).view_as(blocks).abs() <= (step * 0.51 + fp16)[..., None]).all()
    assert len(engine_tokens(path)[0]) == NEW_TOKENS


def test_config_from_metadata(tiny_gguf):
    cfg = ModelConfig.from_pretrained(tiny_gguf("qwen3", "F32"))
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("qwen3", 2, 256, 2, 1, 128)
    assert cfg.qk_norm and not cfg.tie_word_embeddings and cfg.eos_token_ids == (1,)
