"""The adapters an engine holds: `max_loras` resident beside the model, up to `max_cpu_loras` in
host memory, and the rows of each step that use them.

vLLM's two tiers: a step may only use resident adapters (the scheduler admits at most
`max_loras` distinct adapters among the running sequences, engine/scheduler.py), residents are
the step's adapters plus the most recently used others, and the host cache keeps the most
recently used `max_cpu_loras` loaded and validated (a least-recently-used one dropped from it
is read from its folder again when a request names it). On CPU the two tiers are the same
memory, so making an adapter resident costs nothing; on a GPU it is one copy to the device.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedllm.lora.layers import LoRASite, LoRAStep
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.weights import AdapterWeights, LoRAError, SiteShape, load_weights


def pair_dtype(lora_dtype: str, model_dtype: torch.dtype, device_type: str = "cpu") -> torch.dtype:
    """The element type the adapters' pairs are kept in (EngineConfig.lora_dtype): float32 or
    bfloat16 as named; "auto" bfloat16 for a float32 model on the CPU (the fused C step reads the
    pairs: half the bytes, summed in float32), else the model's dtype (vLLM's meaning). Quality
    measured nil (0 of 32 greedy SmolLM2 sequences changed against float32 pairs or transformers +
    PEFT; at most 0.13 in a logit), speed: a batch of 16 over 4 adapters 0.77-0.78x of the base
    with float32 pairs, 0.81-0.83x with bfloat16 (2026-11-28 23:20, after the prefill's C deltas;
    docs/benchmarks.md, "pagedllm bench lora"). float32 is the exact path, PEFT's tokens: every
    PEFT identity test names it."""
    if lora_dtype == "auto":
        return torch.bfloat16 if model_dtype == torch.float32 and device_type == "cpu" else model_dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[lora_dtype]


def attach_sites(model: nn.Module, step: LoRAStep) -> dict[tuple[int, str], SiteShape]:
    """Give every adaptable projection of `model`'s decoder layers a LoRASite; returns their shapes."""
    shapes = {}
    num_layers = len(model.model.layers)
    for index, layer in enumerate(model.model.layers):
        modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
        for name in ("gate_up_proj", "down_proj"):  # dense MLPs only (a MoE layer has experts instead)
            if hasattr(layer.mlp, name):
                modules[name] = getattr(layer.mlp, name)
        for name, linear in modules.items():
            shapes[(index, name)] = SiteShape(linear.in_features, tuple(linear.shard_sizes or (linear.out_features,)))
            linear.lora = LoRASite((index, name), step, shapes[(index, name)], num_layers)
    return shapes


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype, pair_dtype: torch.dtype | None = None):
        """`dtype`: the model's (the modules compute in it); `pair_dtype`: the pairs' element type
        (default `dtype`; AdapterWeights.to says how the two meet)."""
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device, self.dtype, self.pair_dtype = device, dtype, pair_dtype or dtype
        self.step = LoRAStep()
        self.shapes = attach_sites(model, self.step)
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # least recently used first
        self.resident: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.paths: dict[int, tuple[str, str]] = {}  # id -> (name, path) of every adapter seen
        self.loads = 0  # adapters read from their folders (the host cache's misses)

    def add(self, request: LoRARequest) -> AdapterWeights:
        """Load and validate `request`'s adapter into the host cache (a hit only refreshes it)."""
        known = self.paths.get(request.lora_int_id)
        if known is not None and known[1] != request.lora_path:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter {known[0]!r} ({known[1]}); "
                            f"adapter {request.lora_name!r} needs another id")
        weights = self.host.get(request.lora_int_id)
        if weights is None:
            weights = load_weights(request.lora_name, request.lora_int_id, request.lora_path, self.shapes,
                                   self.max_lora_rank)
            self.loads += 1
            self.paths[request.lora_int_id] = (request.lora_name, request.lora_path)
            self.host[request.lora_int_id] = weights
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_int_id)
        return weights

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unloaded): True if it was held. Requests already running with it
        reload it from their own request's path when next scheduled."""
        held = self.host.pop(lora_int_id, None) is not None
        held = self.resident.pop(lora_int_id, None) is not None or held
        self.paths.pop(lora_int_id, None)
        return held

    def activate(self, requests: list[LoRARequest]) -> dict[int, AdapterWeights]:
        """Make a step's adapters resident (least recently used others give way); id -> weights."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters, more than max_loras={self.max_loras}")
        for lora_int_id, request in wanted.items():
            if lora_int_id not in self.resident:
                host = self.host.get(lora_int_id) or self.add(request)
                while len(self.resident) >= self.max_loras:
                    victim = next(i for i in self.resident if i not in wanted)
                    del self.resident[victim]
                self.resident[lora_int_id] = host.to(self.device, self.dtype, self.pair_dtype)  # (CPU, fp32: the same tensors)
            self.resident.move_to_end(lora_int_id)
            if lora_int_id in self.host:
                self.host.move_to_end(lora_int_id)
        return {i: self.resident[i] for i in wanted}

    def set_rows(self, groups: list[tuple[AdapterWeights, slice | torch.Tensor]]) -> None:
        """The rows of the step about to run that use each adapter ([] after it: base rows only)."""
        self.step.set(groups)

