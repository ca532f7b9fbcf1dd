"""A GGUF's hyper-parameters as the Hugging Face config our `ModelConfig` reads.

llama.cpp writes them as `<arch>.<key>` metadata (llama.block_count, llama.rope.freq_base, ...).
Translating them into config.json's names lets one `ModelConfig.from_dict` validate both kinds
of model, so a GGUF gets exactly the checks and defaults a folder gets.
"""
from __future__ import annotations

from typing import Any

from pagedllm.load_errors import ModelLoadError
from pagedllm.gguf.file import GGUFModel

_ARCHITECTURE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_config(model: GGUFModel) -> dict[str, Any]:
    """config.json's fields for this file, checked against the tensors the file holds."""
    heads = int(model.require("attention.head_count"))
    if heads < 1:
        raise ModelLoadError(f"{model.path}: {model.architecture}.attention.head_count={heads}: a model needs at least one head")
    hidden = int(model.require("embedding_length"))
    head_dim = int(model.get("attention.key_length") or hidden // heads)
    _check_against_tensors(model, heads, hidden, head_dim)
    rope_dims = model.get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(f"{model.path}: partial rotary embeddings (rope.dimension_count={rope_dims} of "
                             f"head_dim={head_dim}) are not supported")
    if "rope_freqs.weight" in model.tensors:
        raise ModelLoadError(f"{model.path}: per-dimension rope frequency factors (tensor rope_freqs.weight, "
                             "Llama 3.1-style scaling) are not supported")
    raw: dict[str, Any] = {
        "architectures": [_ARCHITECTURE_CLASSES[model.architecture]],
        "model_type": model.architecture,
        "hidden_size": hidden,
        "num_hidden_layers": int(model.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(model.get("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(model.require("feed_forward_length")),
        "vocab_size": _vocab_size(model),
        "rms_norm_eps": float(model.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(model.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(model.get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "torch_dtype": "float32",
        "eos_token_id": _eos_ids(model),
        "bos_token_id": model.metadata.get("tokenizer.ggml.bos_token_id"),
    }
    scaling = _rope_scaling(model)
    if scaling is not None:
        raw["rope_scaling"] = scaling
    window = model.get("attention.sliding_window")
    if window:
        raw["sliding_window"] = int(window)
        raw["use_sliding_window"] = True
    return raw


def _check_against_tensors(model: GGUFModel, heads: int, hidden: int, head_dim: int) -> None:
    """The header's sizes must describe the tensors the file holds. Everything is allocated from
    the header (the model is built before its weights are read), so a header that lies — 2^31
    blocks in a 2-block file, a 4-billion-wide FFN — would otherwise allocate for the lie."""
    arch = model.architecture
    blocks = {int(name.split(".")[1]) for name in model.tensors if name.startswith("blk.") and name.split(".")[1].isdigit()}
    count = int(model.require("block_count"))
    if len(blocks) != count or (blocks and (min(blocks) != 0 or max(blocks) != count - 1)):
        raise ModelLoadError(f"{model.path}: {arch}.block_count={count}, but the file holds {len(blocks)} blocks "
                             f"(blk.0 .. blk.{max(blocks, default=-1)})")
    # GGUF lists a matrix's dimensions innermost first: (input width, output width)
    expected = {
        "token_embd.weight": (0, hidden, "embedding_length"),
        "blk.0.attn_q.weight": (1, heads * head_dim, "attention.head_count x key_length"),
        "blk.0.ffn_up.weight": (1, int(model.get("feed_forward_length") or 0), "feed_forward_length"),
    }
    for name, (dim, size, field) in expected.items():
        tensor = model.tensors.get(name)
        if tensor is None or len(tensor.shape) < 2:
            continue
        actual = int(tensor.shape[dim])
        if actual != size:
            raise ModelLoadError(f"{model.path}: {arch}.{field}={size} does not match tensor {name} "
                                 f"(shape {[int(d) for d in tensor.shape]})")


def _vocab_size(model: GGUFModel) -> int:
    size = model.get("vocab_size")
    if size is not None:
        return int(size)
    tokens = model.metadata.get("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    embed = model.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{model.path}: no vocabulary size (no {model.architecture}.vocab_size, tokens or token_embd.weight)")
    return int(embed.shape[-1])


def _eos_ids(model: GGUFModel) -> list[int]:
    """The end-of-sequence token and, where the file names one, the end-of-turn token (Llama 3's <|eot_id|>)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [int(model.metadata[k]) for k in keys if model.metadata.get(k) is not None]
    return list(dict.fromkeys(ids))


def _rope_scaling(model: GGUFModel) -> dict[str, Any] | None:
    kind = model.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelLoadError(f"{model.path}: rope scaling {kind!r} is not supported (none, linear)")
    return {"rope_type": "linear", "factor": float(model.require("rope.scaling.factor"))}
