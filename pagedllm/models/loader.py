"""Load a Hugging Face model folder's safetensors, or a GGUF file's tensors, straight into our
modules, by name.

Single files and sharded checkpoints (model.safetensors.index.json) are both read lazily with
safetensors' `safe_open`, one tensor at a time, so peak memory is the model plus one tensor.
Every parameter must be filled exactly once and every checkpoint tensor must have a home:
a mismatch means the folder and our model disagree, and silently running it would be wrong.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import ModelConfig, ModelLoadError, available_memory_bytes
from pagedllm.distributed.group import ParallelGroup, shard_of
from pagedllm.gguf import is_gguf, open_gguf
from pagedllm.gguf.weights import blocks as gguf_blocks
from pagedllm.gguf.weights import tensors as gguf_tensors
from pagedllm.layers.linear import Linear, packing_available
from pagedllm.layers.quantization import Blocks, concat_rows
from pagedllm.models.llama import CausalLM
from pagedllm.models.registry import model_class

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
               group: ParallelGroup | None = None, logit_token_ids: list[int] | None = None,
               quantization: str | None = None, panel_width: int | None = None) -> CausalLM:
    """The whole model, or under tensor parallelism (`group`) this rank's part of it.
    `logit_token_ids`: the LM head scores only these tokens (a draft's reduced vocabulary).
    `quantization`: "int8" or "q4" quantizes every projection and the LM head at load
    (layers/quantization.py); "gguf" keeps a GGUF file's blocks (Q4_0/Q4_1/Q8_0, other block
    types converted; float matrices stay dense). `panel_width`: also pack them for the small-M kernel whose panels
    are that wide (the fused decode step); before oneDNN's packing drops the dense weights."""
    local = cfg.shard(group.size) if group is not None else cfg
    with torch.device("meta"):
        model = model_class(cfg)(local, max_position, dtype, group)
    lazy: set[str] = set()
    if quantization == "gguf" and group is None:
        lazy = _attach_blocks(model, gguf_blocks(open_gguf(cfg.path)))
        if logit_token_ids is not None:
            lazy.discard("lm_head.weight")  # restrict_vocab reads its rows
        _drop_dense(model, lazy)
    if device.type == "cpu":
        _check_fits(model, cfg)
    model.to_empty(device=device)
    model = model.to(dtype)
    # Rotary tables are computed, not loaded: rebuild them on the real device.
    rotary = model.model.rotary
    fresh = type(rotary)(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype).to(device)
    rotary.cos, rotary.sin = fresh.cos, fresh.sin
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_weights(model, Path(cfg.path), group, skip=lazy)
    if logit_token_ids is not None:
        model.restrict_vocab(logit_token_ids)
    model.quantize_and_pack(quantization, panel_width)
    packing = packing_available(device, dtype)
    _dense_where_needed(model, packing, device, dtype)
    if packing:
        model.pack_linears()
    if is_gguf(cfg.path):
        open_gguf(cfg.path).release_pages()  # what loading read is in our tensors now
    return model.eval()


def _drop_dense(model: CausalLM, names: set[str]) -> None:
    """The projections a GGUF file's blocks stand for get no dense weight (still on the meta
    device: nothing is allocated, read or dequantized for them). Where a path does need one — no
    C kernel, no oneDNN packing — `_dense_where_needed` makes it from the blocks afterwards.
    Dequantizing every Q4 matrix only for the kernels to drop it took ~3.5 s of the default
    model's start-up, and the freed floats stayed with the process (worker/malloc.py)."""
    for name in names:
        module = model.get_submodule(name.removesuffix(".weight"))
        module.weight = torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)


def _dense_where_needed(model: CausalLM, packing: bool, device: torch.device, dtype: torch.dtype) -> None:
    """Every projection with blocks that will not run as blocks only (Linear.pack) computes with
    the blocks' dequantized values — the values the C kernels read, so every path agrees."""
    for linear in model.linears():
        if linear.blocks is not None and not (packing and linear.blocks_only()):
            weight = linear.blocks.dequantize().to(device=device, dtype=dtype)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)


def _check_fits(model: CausalLM, cfg: ModelConfig) -> None:
    """Refuse, before a byte is allocated, weights that cannot fit the memory this machine has now:
    a config that names 1,000 layers of 16k width would otherwise be allocated until the kernel
    kills the process (the dense weights are allocated before a GGUF's blocks replace them, so
    this is the load's peak)."""
    tensors = [*model.parameters(), *model.buffers()]
    needed = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    available = available_memory_bytes()
    if needed > available:
        raise ModelLoadError(f"model {cfg.path!r} needs about {needed / 1e9:.1f} GB for its weights, but only "
                             f"{available / 1e9:.1f} GB is available on this machine")


def checkpoint_tensors(path: Path, skip=None) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """(name, tensor, file) for every weight of a model folder or GGUF file, one at a time; a
    GGUF's tensors whose name `skip(name)` is true are not read at all."""
    if is_gguf(path):
        for key, tensor in gguf_tensors(open_gguf(path), skip):
            yield key, tensor, path
        return
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for key in reader.keys():
                    if not _IGNORED.search(key):
                        yield key, reader.get_tensor(key), file
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc


def _load_weights(model: CausalLM, folder: Path, group: ParallelGroup | None, skip: set[str] = frozenset()) -> None:
    """Fill every parameter but those in `skip` (GGUF projections kept as blocks: `_drop_dense`)."""
    params = {name: p for name, p in model.named_parameters() if name not in skip}
    pending = {name: model.expected_shards(name) for name in params}
    for key, tensor, file in checkpoint_tensors(folder, skip=lambda key: model.checkpoint_target(key)[0] in skip):
        _assign(model, params, pending, key, tensor, file, group)
    missing = sorted(name for name, shards in pending.items() if shards)
    if missing:
        raise ModelLoadError(f"{folder} lacks weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if group is not None and not group.is_first:
        for name, param in params.items():  # a row-parallel bias is added once, by rank 0
            if name.endswith(".bias") and model.tp_dim(name[: -len("bias")] + "weight") == 1:
                param.data.zero_()


def _attach_blocks(model: CausalLM, blocks: Iterator[tuple[str, Blocks]]) -> set[str]:
    """Give each projection whose every checkpoint part is block-quantized its blocks (the parts
    of a fused q|k|v or gate|up concatenated by rows). A tied LM head gets the embedding's.
    Returns the names of the weights that got blocks and are parameters of their own (a tied
    LM head's is the embedding's, which is loaded)."""
    parts: dict[str, dict[int, Blocks]] = {}
    kept: set[str] = set()
    for key, value in blocks:
        if key == "model.embed_tokens.weight":
            if not model.config.tie_word_embeddings:
                continue
            key = "lm_head.weight"
        name, shard, _ = model.checkpoint_target(key)
        if name.endswith(".weight"):
            parts.setdefault(name, {})[shard] = value
    for name, shards in parts.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        if isinstance(module, Linear) and set(shards) == model.expected_shards(name):
            module.blocks = concat_rows([shards[i] for i in sorted(shards)])
            kept.add(name)
    own = dict(model.named_parameters())
    return {name for name in kept if name in own}


def _assign(model: CausalLM, params: dict, pending: dict, key: str, tensor: torch.Tensor, file: Path,
            group: ParallelGroup | None) -> None:
    name, shard, part = model.checkpoint_target(key)
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return  # tied: the embedding already provides it
    if name not in params:
        raise ModelLoadError(f"{file.name} holds {key!r}, which this {model.config.architecture} has no place for")
    target = part(params[name].data)
    dim = model.tp_dim(name) if group is not None else None
    if dim is not None and tensor.dim() > dim:
        whole, part_size = tensor.shape[dim], target.shape[dim]
        if not whole > part_size * (group.size - 1) or whole > part_size * group.size:  # only a vocabulary pads
            raise ModelLoadError(f"{key} in {file.name} has {whole} rows/columns along dim {dim}, "
                                 f"which {group.size} ranks of {part_size} do not split")
        tensor = shard_of(tensor, dim, group.rank, part_size)
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"{key} in {file.name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)
    pending[name].discard(shard)
