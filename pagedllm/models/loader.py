"""Load a Hugging Face model folder's safetensors straight into our modules, by name.

Single files and sharded checkpoints (model.safetensors.index.json) are both read lazily with
safetensors' `safe_open`, one tensor at a time, so peak memory is the model plus one tensor.
Every parameter must be filled exactly once and every checkpoint tensor must have a home:
a mismatch means the folder and our model disagree, and silently running it would be wrong.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import ModelConfig, ModelLoadError
from pagedllm.layers.linear import packing_available
from pagedllm.models.llama import CausalLM

_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} is missing shard(s) {missing} named in {index.name}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {str(folder)!r} has no *.safetensors weights")
    return files


def load_model(cfg: ModelConfig, max_position: int, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, panel_width: int | None = None) -> CausalLM:
    """`quantization`: "int8" quantizes every projection and the LM head at load
    (layers/quantization.py). `panel_width`: also pack them for the small-M kernel whose panels
    are that wide (the fused decode step); before oneDNN's packing drops the dense weights."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_position, dtype)
    model.to_empty(device=device)
    model = model.to(dtype)
    # Rotary tables are computed, not loaded: rebuild them on the real device.
    rotary = model.model.rotary
    fresh = type(rotary)(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype).to(device)
    rotary.cos, rotary.sin = fresh.cos, fresh.sin
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_weights(model, Path(cfg.path))
    model.quantize_and_pack(quantization, panel_width)
    if packing_available(device, dtype):
        model.pack_linears()
    return model.eval()


def _load_weights(model: CausalLM, folder: Path) -> None:
    params = dict(model.named_parameters())
    pending = {name: _expected_shards(model, name) for name in params}
    for file in checkpoint_files(folder):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for key in reader.keys():
                    if _IGNORED.search(key):
                        continue
                    _assign(model, params, pending, key, reader.get_tensor(key), file)
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    missing = sorted(name for name, shards in pending.items() if shards)
    if missing:
        raise ModelLoadError(f"{folder} lacks weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _expected_shards(model: CausalLM, name: str) -> set[int]:
    for fused in ("qkv_proj", "gate_up_proj"):
        if f".{fused}." in name:
            return set(range(len(model.shard_sizes(fused))))
    return {0}


def _assign(model: CausalLM, params: dict, pending: dict, key: str, tensor: torch.Tensor, file: Path) -> None:
    name, shard = key, None
    for ckpt_name, (fused, index) in model.packed_modules.items():
        if f".{ckpt_name}." in key:
            name, shard = key.replace(f".{ckpt_name}.", f".{fused}."), index
            break
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return  # tied: the embedding already provides it
    if name not in params:
        raise ModelLoadError(f"{file.name} holds {key!r}, which this {model.config.architecture} has no place for")
    target = params[name].data
    if shard is not None:
        sizes = model.shard_sizes(name.split(".")[-2])
        target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"{key} in {file.name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)
    pending[name].discard(shard or 0)
