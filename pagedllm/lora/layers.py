"""The per-row low-rank delta, added where a step's rows use an adapter.

Each projection a LoRA may target carries a `LoRASite` (`linear.lora`). Before a forward pass the
runner tells the sites' shared `LoRAStep` which rows use which adapter (rows grouped by
adapter); each site then adds, per group, (x[rows] @ A^T) @ B^T to those rows of its output —
Punica's shrink and expand, one pair of matmuls per adapter group, while base rows cost nothing.
The gated MLP's fused gate/up projection returns silu(gate) * up, so for adapter rows the site
recomputes the raw gate and up (the same weights: the GGUF blocks through the C kernel, the
oneDNN-packed halves, or the dense weight), adds the delta, then applies silu * up; base rows
keep the fused result bit for bit (their tokens do not depend on what else shares the step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.lora.weights import AdapterWeights

Rows = slice | torch.Tensor


@dataclass
class LoRAStep:
    """The rows of the step being run that use an adapter: (adapter, rows) per adapter."""

    groups: list[tuple[AdapterWeights, Rows]] = field(default_factory=list)


class LoRASite:
    """One projection of one layer (`key` = (layer index, site name)) that adapters may target."""

    def __init__(self, key: tuple[int, str], step: LoRAStep):
        self.key = key
        self.step = step

    @property
    def active(self) -> bool:
        return bool(self.step.groups)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`) with each adapter group's delta added to its rows."""
        for weights, rows in self.step.groups:
            delta = weights.sites.get(self.key)
            if delta is not None:
                out[rows] += (x[rows] @ delta.a_t) @ delta.b_t
        return out

    def gate_up(self, linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` = silu(gate) * up of every row; adapter rows recomputed from their adapted gate and up."""
        for weights, rows in self.step.groups:
            delta = weights.sites.get(self.key)
            if delta is None:
                continue
            xs = x[rows]
            gate, up = (raw_gate_up(linear, xs) + (xs @ delta.a_t) @ delta.b_t).chunk(2, dim=-1)
            out[rows] = F.silu(gate) * up
        return out


def raw_gate_up(linear, x: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * intermediate]: gate and up before the activation, from whichever copy of the
    weight the layer keeps. GGUF blocks kept only as SwiGLU panels get plain panels of the same
    blocks, packed on first use (only models that serve gate/up adapters pay for them)."""
    if linear.library is not None:
        from pagedllm.layers.small_matmul import matmul, pack_blocks

        raw = getattr(linear, "raw_small", None)
        if raw is None:
            raw = linear.raw_small = pack_blocks(linear.blocks, linear.library.panel_width(), linear.bias)
        raw.int8_activations = linear.small.int8_activations
        return matmul(linear.library, x, raw)
    if linear.gate_packed is not None:
        pointwise = torch.ops.mkldnn._linear_pointwise
        return torch.cat((pointwise(x, linear.gate_packed, linear.gate_bias, "none", [], ""),
                          pointwise(x, linear.up_packed, linear.up_bias, "none", [], "")), dim=-1)
    return F.linear(x, linear.weight, linear.bias)
