"""A GGUF's tensors under Hugging Face names, dequantized to float32 (gguf.quants), in the
orientation transformers' checkpoints have.

Two things differ from a safetensors checkpoint. Names: llama.cpp calls model.layers.3.mlp.up_proj
`blk.3.ffn_up`. And llama.cpp's converter permutes the rows of Llama/Mistral q and k projections
so that its rope rotates adjacent pairs (GPT-J style) where transformers rotates the two halves of
each head (NeoX style); `_unpermute` puts the rows back, as transformers' own GGUF loader does.
Qwen files are not permuted (llama.cpp runs them with NeoX rope).

`blocks()` gives the block-quantized matrices as blocks, for the engine to keep quantized
(quantization "gguf", the default for GGUF files).
"""
from __future__ import annotations

import re
from typing import Callable, Iterator

import numpy as np
import torch

from pagedllm.load_errors import ModelLoadError
from pagedllm.gguf.file import GGUFModel
from pagedllm.layers.quantization import KEPT_TYPES, Blocks, quantize_blocks

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


def _hf_rows(model: GGUFModel, key: str, rows: np.ndarray) -> np.ndarray:
    """A matrix's rows (values, or a row's blocks) in transformers' order."""
    if model.architecture not in _PERMUTED or not (".q_proj." in key or ".k_proj." in key):
        return rows
    heads = int(model.require("attention.head_count"))
    if ".k_proj." in key:
        heads = int(model.get("attention.head_count_kv") or heads)
    return _unpermute(rows, heads)


def _key(model: GGUFModel, name: str) -> str:
    key = hf_name(name)
    if key is None:
        raise ModelLoadError(f"{model.path}: tensor {name!r} has no place in a {model.architecture} model")
    return key


def tensors(model: GGUFModel, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, one at a time; those
    whose name `skip` is true for are neither read nor dequantized."""
    for name, tensor in model.tensors.items():
        key = _key(model, name)
        if skip is not None and skip(key):
            continue
        values = _hf_rows(model, key, dequantize(tensor))
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            values = values.copy()
        yield key, torch.from_numpy(np.ascontiguousarray(values))


# Block-quantized types the kernels do not read, and the kept type each is converted to at load:
# 4-bit ones to Q4_1 (4 bits, a scale and a min per 32), wider ones to Q8_0.
CONVERTED = {"Q4_K": "Q4_1", "Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q5_K": "Q8_0", "Q6_K": "Q8_0"}


def blocks(model: GGUFModel) -> Iterator[tuple[str, Blocks]]:
    """(Hugging Face name, blocks) of every block-quantized matrix: Q4_0, Q4_1 and Q8_0 as the
    file stores them (llama q/k rows unpermuted, each row's blocks unchanged), other block types
    converted to the nearest kept type from their dequantized values (CONVERTED)."""
    for name, tensor in model.tensors.items():
        kind = tensor.tensor_type.name
        if len(tensor.shape) != 2 or (kind not in KEPT_TYPES and kind not in CONVERTED):
            continue
        key = _key(model, name)
        if kind in KEPT_TYPES:
            rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)
            yield key, Blocks(kind, np.ascontiguousarray(_hf_rows(model, key, rows)))
        else:
            values = _hf_rows(model, key, dequantize(tensor))
            yield key, quantize_blocks(torch.from_numpy(np.ascontiguousarray(values)), CONVERTED[kind])
