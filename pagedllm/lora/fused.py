"""A step's adapters described to the fused C decode step (csrc/decode_step.c, Step.lora).

The C step adds each adapter row's delta after qkv, o and down and before gate/up's SiLU, from
each projection's own pair (lora/weights.py: a [r, k], b_t [r, n], scaled), float32 or bfloat16
(the engine's lora_dtype; the C step widens bfloat16 as it reads). Each adapter's pairs are laid
out once as C structs (cached on its weights); a step copies them side by side and says which
adapter each row uses."""
from __future__ import annotations

import ctypes

import torch

from pagedllm.layers.kernel_interface import STRUCTS
from pagedllm.lora.layers import raw_panels
from pagedllm.lora.weights import AdapterWeights

LoraPair, LoraStruct, Matrix = STRUCTS["LoraPair"], STRUCTS["Lora"], STRUCTS["Matrix"]
PROJECTIONS = 7  # q, k, v, o, gate, up, down per layer: lora/weights.TARGETS' order, the C step's
MAX_RANK = 256  # csrc/decode_step.c's LORA_MAX_RANK: an adapter of a higher rank runs the modules


def _pairs(weights: AdapterWeights, num_layers: int):
    """The adapter's [num_layers * 7] LoraPair array, built once per weights object."""
    cached = getattr(weights, "_c_pairs", None)
    if cached is None:
        cached = (LoraPair * (num_layers * PROJECTIONS))()
        for (layer, index), (a, b_t) in weights.projections.items():
            cached[layer * PROJECTIONS + index] = LoraPair(a=a.data_ptr(), b_t=b_t.data_ptr(), rank=a.shape[0],
                                                           a_capacity=a.numel(), b_capacity=b_t.numel(),
                                                           bf16=int(a.dtype == torch.bfloat16))
        weights._c_pairs = cached
    return cached


def _raw_matrices(model):
    """Every layer's raw gate/up panels as C structs, built once per int8-activations setting
    (decode steps may multiply int8 activations, and the struct carries the flag)."""
    layers = model.model.layers
    on = bool(layers[0].mlp.gate_up_proj.small.int8_activations)
    cache = model.__dict__.setdefault("_lora_raw_matrices", {})
    if on not in cache:
        panels = [raw_panels(layer.mlp.gate_up_proj) for layer in layers]
        cache[on] = None if any(p is None for p in panels) else ((Matrix * len(layers))(*[p.struct() for p in panels]), panels)
    return cache[on][0] if cache[on] is not None else None


def fusable(weights: AdapterWeights) -> bool:
    """Pairs the C step reads: on CPU, float32 or bfloat16 (lora_dtype), of a rank its stack takes."""
    return _facts(weights)[0]


def _facts(weights: AdapterWeights) -> tuple[bool, bool]:
    """(fusable, targets gate/up) of an adapter, found once per weights object: every step asks,
    and walking a SmolLM2 adapter's 210 pairs each time cost ~0.3 ms a step per adapter."""
    cached = getattr(weights, "_c_facts", None)
    if cached is None:
        ok = all(a.dtype == b.dtype and a.dtype in (torch.float32, torch.bfloat16) and a.device.type == "cpu"
                 and a.shape[0] <= MAX_RANK for a, b in weights.projections.values())
        cached = weights._c_facts = (ok, any(site == "gate_up_proj" for _, site in weights.sites))
    return cached


def fused_lora(model, groups: list, num_rows: int) -> tuple[object, list] | None:
    """(the Lora struct, what it points into) for a step of `num_rows` rows whose adapter rows are
    `groups`; None when the C step cannot take them (then the modules run the step)."""
    layers = model.model.layers
    num_layers = len(layers)
    if not all(fusable(weights) for weights, _ in groups):
        return None
    raws = None
    if any(_facts(weights)[1] for weights, _ in groups):
        raws = _raw_matrices(model)
        if raws is None:
            return None
    return describe(groups, num_rows, num_layers, raws)


def describe(groups: list, num_rows: int, num_layers: int, raws=None) -> tuple[object, list]:
    """(the Lora struct of `groups` over `num_rows` rows, what it points into): the fused step's,
    and the prefill's `lora_delta` (lora/layers.py, no raw gate/up panels). The adapters must be
    fusable."""
    size = num_layers * PROJECTIONS * ctypes.sizeof(LoraPair)
    pairs = (LoraPair * (num_layers * PROJECTIONS * len(groups)))()
    row_adapter = torch.full((num_rows,), -1, dtype=torch.int64)
    for index, (weights, rows) in enumerate(groups):
        ctypes.memmove(ctypes.addressof(pairs) + index * size, _pairs(weights, num_layers), size)
        row_adapter[rows] = index
    struct = LoraStruct(num_adapters=len(groups), row_adapter=row_adapter.data_ptr(), pairs=pairs, gate_up_raw=raws)
    return struct, [row_adapter, pairs, raws, [w for w, _ in groups]]
