"""The per-row low-rank delta, added where a step's rows use an adapter.

Each projection a LoRA may target carries a `LoRASite` (`linear.lora`). Before a forward pass the
runner tells the sites' shared `LoRAStep` which rows use which adapter (rows grouped by
adapter); each site then adds, per group, (x[rows] @ A^T) @ B^T to those rows of its output —
Punica's shrink and expand, one pair of matmuls per adapter group, while base rows cost nothing;
on the CPU in float32 one C call a site does it for every group (csrc/decode_step.c's lora_delta).
The gated MLP's fused gate/up projection returns silu(gate) * up, so in a step with adapter rows
the site computes the raw gate and up of every row instead (the same weights: the GGUF blocks
through the C kernel, the oneDNN-packed halves, or the dense weight), adds the deltas, then
applies silu * up: one product, not the fused one plus a second for the adapter rows. (Base rows
of such a step may differ from a base-only step's in the last bits, as the torch path and the
fused C decode step already do.)
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.lora.raw_panels import raw_panels
from pagedllm.lora.weights import AdapterWeights

Rows = slice | torch.Tensor


@dataclass
class LoRAStep:
    """The rows of the step being run that use an adapter: (adapter, rows) per adapter."""

    groups: list[tuple[AdapterWeights, Rows]] = field(default_factory=list)
    described: dict = field(default_factory=dict)  # rows -> the C kernel's Lora struct of this step

    def set(self, groups: list[tuple[AdapterWeights, Rows]]) -> None:
        self.groups, self.described = groups, {}

    def c_struct(self, num_rows: int, num_layers: int):
        """The Lora struct of this step's adapters over `num_rows` rows (lora/fused.describe), built
        once a step; None when the C kernel cannot take them (pairs of another dtype or rank)."""
        if num_rows not in self.described:
            from pagedllm.lora.fused import describe, fusable

            ok = all(fusable(weights) for weights, _ in self.groups)
            self.described[num_rows] = describe(self.groups, num_rows, num_layers) if ok else None
        found = self.described[num_rows]
        return found[0] if found is not None else None


# a site -> its first projection in the C kernels' order (q, k, v, o, gate, up, down)
FIRST_PROJECTION = {"qkv_proj": 0, "o_proj": 3, "gate_up_proj": 4, "down_proj": 6}


class LoRASite:
    """One projection of one layer (`key` = (layer index, site name)) that adapters may target;
    `shape` (its inputs, its shards' outputs) and the model's `num_layers` let the C kernel take
    its deltas (without them, the PyTorch ops do)."""

    def __init__(self, key: tuple[int, str], step: LoRAStep, shape=None, num_layers: int = 0):
        self.key = key
        self.step = step
        self.num_layers = num_layers
        # each projection's (k, n, first output column) for lora_delta
        self._shapes = None if shape is None else torch.tensor(
            [[shape.in_features, n, sum(shape.shard_sizes[:i])] for i, n in enumerate(shape.shard_sizes)], dtype=torch.int64)

    @property
    def active(self) -> bool:
        return bool(self.step.groups)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`) with each adapter group's delta added to its rows: one
        C call for them all where it takes them (`_c_delta`); else per group, in place (addmm_ on
        the rows' view) when they are one slice, index_add_ otherwise."""
        if self._c_delta(x, out):
            return out
        for weights, rows in self.step.groups:
            delta = weights.sites.get(self.key)
            if delta is None:
                continue
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ delta.a_t, delta.b_t)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ delta.a_t) @ delta.b_t)
        return out

    def _c_delta(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """The deltas in one C call (csrc/decode_step.c's lora_delta: the fused step's shrink and
        expand, the rows over the threads), where it takes them: float32 rows on the CPU, pairs
        the fused step reads. False: the PyTorch ops below."""
        from pagedllm.layers import kernels

        if (self._shapes is None or x.device.type != "cpu" or x.dtype != torch.float32 or out.dtype != torch.float32
                or out.dim() != 2 or not out.is_contiguous()):
            return False
        library = kernels.load()
        struct = self.step.c_struct(out.shape[0], self.num_layers) if library is not None else None
        if struct is None:
            return False
        inputs = x.contiguous()
        layer, site = self.key
        status = library.lora_delta(ctypes.byref(struct), self.num_layers, layer, FIRST_PROJECTION[site], len(self._shapes),
                                    self._shapes.data_ptr(), inputs.data_ptr(), inputs.shape[0], inputs.shape[1], inputs.numel(),
                                    out.data_ptr(), out.shape[1], out.numel(), torch.get_num_threads())
        kernels.check_status(status, library, "LoRA delta")
        return True

    def gate_up(self, linear, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of every row, adapter rows' gate and up adapted (module docstring)."""
        return _silu_mul(self.add_delta(x, raw_gate_up(linear, x)))


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
