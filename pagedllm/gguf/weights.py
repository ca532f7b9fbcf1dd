"""A GGUF's tensors under Hugging Face names, dequantized to float32 (gguf.quants), in the
orientation transformers' checkpoints have.

Two things differ from a safetensors checkpoint. Names: llama.cpp calls model.layers.3.mlp.up_proj
`blk.3.ffn_up`. And llama.cpp's converter permutes the rows of Llama/Mistral q and k projections
so that its rope rotates adjacent pairs (GPT-J style) where transformers rotates the two halves of
each head (NeoX style); `_unpermute` puts the rows back, as transformers' own GGUF loader does.
Qwen files are not permuted (llama.cpp runs them with NeoX rope).
"""
from __future__ import annotations

import re
from typing import Iterator

import numpy as np
import torch

from pagedllm.config import ModelLoadError
from pagedllm.gguf.file import GGUFModel

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTED = ("llama", "mistral")


def hf_name(name: str) -> str | None:
    """The Hugging Face checkpoint name of GGUF tensor `name`, or None if it has none."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    match = _LAYER_NAME.fullmatch(name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}.{match.group(3)}"
    return None


def dequantize(tensor) -> np.ndarray:
    """A reader tensor's values as float32, shaped [rows, columns] like a torch weight."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: rows of each head go from pairs-interleaved back to halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(model: GGUFModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, one at a time."""
    permute = model.architecture in _PERMUTED
    heads = int(model.require("attention.head_count"))
    kv_heads = int(model.get("attention.head_count_kv") or heads)
    for name, tensor in model.tensors.items():
        key = hf_name(name)
        if key is None:
            raise ModelLoadError(f"{model.path}: tensor {name!r} has no place in a {model.architecture} model")
        values = dequantize(tensor)
        if permute and ".q_proj." in key:
            values = _unpermute(values, heads)
        elif permute and ".k_proj." in key:
            values = _unpermute(values, kv_heads)
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            values = values.copy()
        yield key, torch.from_numpy(np.ascontiguousarray(values))
