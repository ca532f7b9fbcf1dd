"""The per-row low-rank delta, added where a step's rows use an adapter.

Each projection a LoRA may target carries a `LoRASite` (`linear.lora`). Before a forward pass the
runner tells the sites' shared `LoRAStep` which rows use which adapter (rows grouped by
adapter); each site then adds, per group, (x[rows] @ A^T) @ B^T to those rows of its output —
Punica's shrink and expand, one pair of matmuls per adapter group, while base rows cost nothing;
or, for several groups of a small total rank, one shrink and one expand through their pairs
stacked, each row masked to its own adapter's columns (fewer, larger products).
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


# The most rank of a site's adapters stacked into one pair (LoRASite._stacked_delta): up to it one
# shrink and one expand serve every group of a step, whose extra products (each row times every
# adapter's pair, masked) cost less than a small op per group: ~0.1 ms each at 2 threads.
STACKED_MAX_RANK = 64


@dataclass
class LoRAStep:
    """The rows of the step being run that use an adapter: (adapter, rows) per adapter; `masks`
    caches, for this step's rows, each stacking's row-to-columns mask (set() clears it)."""

    groups: list[tuple[AdapterWeights, Rows]] = field(default_factory=list)
    masks: dict = field(default_factory=dict)
    described: dict = field(default_factory=dict)  # rows -> the C kernel's Lora struct of this step

    def set(self, groups: list[tuple[AdapterWeights, Rows]]) -> None:
        self.groups, self.masks, self.described = groups, {}, {}

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
    its deltas."""

    def __init__(self, key: tuple[int, str], step: LoRAStep, shape=None, num_layers: int = 0):
        self.key = key
        self.step = step
        self.shape, self.num_layers = shape, num_layers
        self._shapes: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return bool(self.step.groups)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`) with each adapter group's delta added to its rows:
        several groups of a small total rank through one stacked pair (`_stacked_delta`); else per
        group, in place (addmm_ on the rows' view) when they are one slice, index_add_ otherwise."""
        if self._c_delta(x, out):
            return out
        present = [(weights, rows, weights.sites[self.key]) for weights, rows in self.step.groups if self.key in weights.sites]
        if len(present) > 1 and sum(d.a_t.shape[1] for _, _, d in present) <= STACKED_MAX_RANK and out.dim() == 2:
            return self._stacked_delta(x, out, present)
        for weights, rows, delta in present:
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

        if (self.shape is None or x.device.type != "cpu" or x.dtype != torch.float32 or out.dtype != torch.float32
                or out.dim() != 2 or not out.is_contiguous()):
            return False
        library = kernels.load()
        struct = self.step.c_struct(out.shape[0], self.num_layers) if library is not None else None
        if struct is None:
            return False
        if self._shapes is None:
            sizes = self.shape.shard_sizes
            self._shapes = torch.tensor([[self.shape.in_features, n, sum(sizes[:i])] for i, n in enumerate(sizes)],
                                        dtype=torch.int64)
        inputs = x.contiguous()
        layer, site = self.key
        status = library.lora_delta(ctypes.byref(struct), self.num_layers, layer, FIRST_PROJECTION[site], len(self._shapes),
                                    self._shapes.data_ptr(), inputs.data_ptr(), inputs.shape[0], inputs.shape[1], inputs.numel(),
                                    out.data_ptr(), out.shape[1], out.numel(), torch.get_num_threads())
        kernels.check_status(status, library, "LoRA delta")
        return True

    def _stacked_delta(self, x: torch.Tensor, out: torch.Tensor, present: list) -> torch.Tensor:
        """out += ((x @ [a_t of every group]) * mask) @ [b_t of every group]: the mask keeps each row's
        own adapter's rank columns (zero for base rows), so each row gets its own delta: three ops
        for the site instead of four per group (a prefill of 16 prompts over 4 adapters: ~0.2 s of
        index_select / mm / mm / index_add_). The stacked pairs are kept per set of adapters."""
        ids = tuple(weights.lora_int_id for weights, _, _ in present)
        cached = getattr(self, "_stacked", None)
        if cached is None or cached[0] != ids or any(a is not d.a_t for a, (_, _, d) in zip(cached[1], present)):
            deltas = [d for _, _, d in present]
            cached = self._stacked = (ids, [d.a_t for d in deltas],
                                      torch.cat([d.a_t for d in deltas], 1), torch.cat([d.b_t for d in deltas], 0))
        a_all, b_all = cached[2], cached[3]
        key = (ids, tuple(d.a_t.shape[1] for _, _, d in present), out.shape[0])
        mask = self.step.masks.get(key)
        if mask is None:
            mask = torch.zeros(out.shape[0], a_all.shape[1], dtype=x.dtype, device=x.device)
            col = 0
            for _, rows, delta in present:
                mask[rows, col:col + delta.a_t.shape[1]] = 1
                col += delta.a_t.shape[1]
            self.step.masks[key] = mask
        return out.addmm_(torch.mm(x, a_all).mul_(mask), b_all)

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
