"""The per-row low-rank delta, added where a step's rows use an adapter.

Each projection a LoRA may target carries a `LoRASite` (`linear.lora`). Before a forward pass the
runner tells the sites' shared `LoRAStep` which rows use which adapter (rows grouped by
adapter); each site then adds, per group, (x[rows] @ A^T) @ B^T to those rows of its output —
Punica's shrink and expand, one pair of matmuls per adapter group, while base rows cost nothing.
The gated MLP's fused gate/up projection returns silu(gate) * up, so in a step with adapter rows
the site computes the raw gate and up of every row instead (the same weights: the GGUF blocks
through the C kernel, the oneDNN-packed halves, or the dense weight), adds the deltas, then
applies silu * up: one product, not the fused one plus a second for the adapter rows. (Base rows
of such a step may differ from a base-only step's in the last bits, as the torch path and the
fused C decode step already do.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.layers.small_matmul import PackedWeight
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
        """`out` (the base projection of `x`) with each adapter group's delta added to its rows:
        in place (addmm_ on the rows' view) when they are one slice, index_add_ otherwise."""
        for weights, rows in self.step.groups:
            delta = weights.sites.get(self.key)
            if delta is None:
                continue
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ delta.a_t, delta.b_t)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ delta.a_t) @ delta.b_t)
        return out

    def gate_up(self, linear, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of every row, adapter rows' gate and up adapted (module docstring)."""
        return _silu_mul(self.add_delta(x, raw_gate_up(linear, x)))


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def raw_panels(linear) -> PackedWeight | None:
    """The gate/up projection's small-M panels as a plain matrix (gate channels, then up), made
    on first use from its SwiGLU panels, which alternate a gate panel and an up panel: the same
    panels (the same bits: fp32, int8 or GGUF blocks) in another order, so no second copy of
    the weight is read from the checkpoint. None where there are no panels, or where the
    intermediate size is not a whole number of panels (each half is padded then)."""
    small = linear.small
    if small is None or not small.swiglu:
        return None
    raw = getattr(linear, "raw_small", None)
    if raw is None:
        from pagedllm.layers import kernels

        half, width = small.num_panels // 2, kernels.load().panel_width()  # (every pack of a process is this wide)
        if small.n // 2 != half * width:
            return None
        order = torch.cat((torch.arange(0, small.num_panels, 2), torch.arange(1, small.num_panels, 2)))
        lane = lambda t: None if t is None else t.view(small.num_panels, -1)[order].reshape(-1).contiguous()  # noqa: E731
        raw = linear.raw_small = PackedWeight(small.panels[order].contiguous(), lane(small.scale), lane(small.bias), small.n,
                                              small.k, swiglu=False, kind=small.kind)
    raw.int8_activations = linear.small.int8_activations
    return raw


def raw_gate_up(linear, x: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * intermediate]: gate and up before the activation, from whichever copy of the
    weight the layer keeps (GGUF blocks kept only as SwiGLU panels: `raw_panels`)."""
    if linear.library is not None:
        from pagedllm.layers.small_matmul import matmul

        raw = raw_panels(linear)
        if raw is None:
            raise ValueError("gate/up LoRA on block-quantized panels needs an intermediate size of whole panels")
        return matmul(linear.library, x, raw)
    if linear.gate_packed is not None:
        pointwise = torch.ops.mkldnn._linear_pointwise
        return torch.cat((pointwise(x, linear.gate_packed, linear.gate_bias, "none", [], ""),
                          pointwise(x, linear.up_packed, linear.up_bias, "none", [], "")), dim=-1)
    return F.linear(x, linear.weight, linear.bias)
