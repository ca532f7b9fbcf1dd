"""Tiny GGUF files for tests, written with the `gguf` package from tiny Hugging Face folders
(tests/tiny_models.py), the way llama.cpp's converter writes them: hyper-parameters and the
tokenizer as metadata, Llama q/k rows permuted for llama.cpp's rope, weights in a chosen type.

K-quant blocks (Q4_K, Q6_K) cannot be written from weights (the gguf package has no quantizer for
them), so those tensors hold random but valid blocks: the reference is transformers reading the
same file, not the folder it came from.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(key: str) -> str:
    base, _, suffix = key.rpartition(".")
    if base in _NAMES:
        return f"{_NAMES[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of Llama q/k rows (halves -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of a K-quant type: small finite fp16 scales, random quants."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = lambda n: rng.uniform(0.002, 0.02, size=(rows, cols // block, n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == GGMLQuantizationType.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales, 128 bytes of nibbles
        data[..., :4] = scale(2)
    elif qtype == GGMLQuantizationType.Q6_K:  # ql[128], qh[64], int8 scales[16], d (fp16)
        data[..., 208:210] = scale(1)
        data[..., 192:208] = rng.integers(-8, 8, size=(rows, cols // block, 16), dtype=np.int8).view(np.uint8)
    else:
        raise ValueError(qtype)
    return data.reshape(rows, -1)


def encode(values: np.ndarray, type_name: str, rng: np.random.Generator):
    """(data, raw_dtype) of a 2-D weight in type `type_name`."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    if type_name in ("Q4_K", "Q6_K"):
        return random_blocks(qtype, *values.shape, rng), qtype
    return quants.quantize(values.astype(np.float32), qtype), qtype


def write_gguf(folder: Path, path: Path, arch: str = "llama", weight_type: str = "F32",
               types: dict[str, str] | None = None, seed: int = 0) -> Path:
    """Write the tiny HF model in `folder` as a GGUF at `path`. Every 2-D weight is written as
    `weight_type` unless `types` names another for a GGUF tensor name (e.g. {"token_embd.weight": "Q8_0"});
    norms and biases stay F32, as llama.cpp writes them."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    name = GGUF_ARCH[arch]
    writer = gguf.GGUFWriter(str(path), name)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    writer.add_vocab_size(config["vocab_size"])
    _write_tokenizer(writer, folder)
    rng = np.random.default_rng(seed)
    weights = load_file(str(folder / "model.safetensors"))
    for key, tensor in sorted(weights.items()):
        values = tensor.to(torch.float32).numpy()
        if name == "llama" and ".q_proj." in key:
            values = permute(values, heads)
        elif name == "llama" and ".k_proj." in key:
            values = permute(values, kv_heads)
        target = gguf_name(key)
        kind = (types or {}).get(target, weight_type) if values.ndim == 2 else "F32"
        data, raw = encode(values, kind, rng)
        writer.add_tensor(target, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_tokenizer(writer, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_pad_token_id(vocab["<pad>"])
    writer.add_add_bos_token(False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
