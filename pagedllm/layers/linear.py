"""Linear layers whose weights oneDNN reorders once, at load time, on CPU.

`F.linear` hands the weight to MKL's sgemm, which repacks it on every call: a full extra read and
write of every weight, every step. On this machine that left decode matmuls at 6–8 GB/s of a
31 GB/s memory system. oneDNN's inner product with a weight reordered once into its blocked
format (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch.compile emits
for CPU linears) measured, on SmolLM2-135M's 121 projections: 3.5x faster at batch 2, 1.5x at
batch 64 and 1.3x at batch 2048 (prefill).

It is also *batch-invariant*: a row's result is bitwise the same whatever else is in the batch
(F.linear's is not), which is what makes "same seed, same tokens, whatever shares the batch"
hold by construction. Results differ from MKL's in the last bits (~1e-6). (Steps of at most 16
decode rows run the fused decode step instead, itself batch-invariant; the two differ in the
last bits, docs/engine.md.)

For decode steps of a few rows the weights are also packed for the small-M kernel
(layers/small_matmul.py), which the fused decode step reads; with `quantization="int8"` that copy
is int8 with per-channel scales, and the module's own weight becomes its dequantized values, so
the PyTorch path (prefills, large batches, the reference) computes with exactly the weights the
int8 kernel uses. GGUF blocks (Q4_0/Q4_1/Q8_0, a file's own or "q4"'s) are kept only as panels:
the module computes every product with the C kernel and keeps no dense copy, so a 4-bit model
takes 5 bits a weight in memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import kernels, triton_ops
from pagedllm.layers.quantization import BLOCK, Blocks, dequantize_int8, quantize_blocks, quantize_int8
from pagedllm.layers.small_matmul import PackedWeight, matmul, pack, pack_blocks, pack_swiglu

# Batch size oneDNN optimises the weight layout for. From 16 up, results are batch-invariant
# and speed is flat across hints; 64 is a typical decode batch.
_PACK_HINT = 64
_PACKABLE = (torch.float32, torch.bfloat16)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in _PACKABLE
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Linear):
    """nn.Linear that, once packed, runs through oneDNN with its pre-reordered weight."""

    packed_weight: torch.Tensor | None = None
    # A fused projection's output rows, split as the checkpoint's separate projections (q|k|v).
    shard_sizes: tuple[int, ...] | None = None
    quantizable = True  # False for weights whose precision decisions hang on (a MoE router)
    small: PackedWeight | None = None  # panels for the small-M kernel (the fused decode step)
    weight_scale: torch.Tensor | None = None  # int8: per-channel scales; the weight holds q * scale
    # GGUF blocks of 32 (Q4_0/Q4_1/Q8_0): a GGUF file's own (the loader attaches them) or "q4"'s
    blocks: Blocks | None = None
    q4_kind = "Q4_1"  # the block type "q4" quantizes to (the LM head keeps 8 bits, as llama.cpp's files do)
    library = None  # the C kernels, once the blocks are the only copy of the weight (pack)
    lora = None  # a LoRASite when adapters may target this projection (lora/layers.py)

    def quantize(self, method: str) -> torch.Tensor | None:
        """Weight-only quantization (layers/quantization.py); returns int8's q. The weight is
        replaced by a new tensor of its dequantized values (so the PyTorch path computes with
        exactly the weights the C kernel reads), which unties a tied LM head from the embedding:
        the embedding lookup keeps the checkpoint's values, as llama.cpp and vLLM keep
        embeddings. "gguf" keeps the blocks the loader attached, and the loader gives the weight their
        values where a dense one is needed (models/loader.py `_dense_where_needed`)."""
        if method == "int8":
            q, self.weight_scale = quantize_int8(self.weight)
            self.weight = nn.Parameter(dequantize_int8(q, self.weight_scale).to(self.weight.dtype), requires_grad=False)
            return q
        if method == "q4" and self.in_features % BLOCK == 0:
            self.blocks = quantize_blocks(self.weight, self.q4_kind)
            self.weight = nn.Parameter(self.blocks.dequantize().to(self.weight.dtype), requires_grad=False)
        elif method not in ("q4", "gguf"):
            raise ValueError(f"quantization must be 'int8', 'q4' or 'gguf', got {method!r}")
        return None  # "gguf": the loader gives a dense weight only where one is needed (models/loader.py)

    def pack_small(self, width: int, quantized: torch.Tensor | None = None) -> None:
        """Pack the weight, its int8 values `quantized`, or its blocks, into panels `width` channels wide."""
        if self.blocks is not None:
            self.small = pack_blocks(self.blocks, width, self.bias)
            return
        self.small = pack(quantized if quantized is not None else self.weight, width, self.bias, self.weight_scale)

    def pack(self, keep_dense: bool) -> None:
        """Reorder the weight for oneDNN. The dense copy is dropped unless something else shares
        it (tied embeddings), so packing does not double the model's memory. Blocks packed for
        the C kernel are the weight itself: every product (prefills and large batches too) reads
        them, and no dense copy is kept."""
        if self.blocks_only():
            self.library = kernels.load()
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
            return
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_HINT)
        if not keep_dense:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def blocks_only(self) -> bool:
        """Packing keeps the blocks alone (the C kernel computes every product from them)."""
        return self.blocks is not None and self.small is not None and kernels.load() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base(x)
        if self.lora is not None and self.lora.active:  # a step with adapter rows adds their deltas
            return self.lora.add_delta(x, out)
        return out

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.library is not None:
            out = matmul(self.library, x.reshape(-1, x.shape[-1]), self.small)
            return out.view(*x.shape[:-1], out.shape[-1])  # (the width named: a batch may have no rows)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class GateUpLinear(Linear):
    """The fused gate/up projection of a gated MLP, returning silu(gate) * up.

    Packed, gate and up are reordered separately so oneDNN applies SiLU to the gate GEMM's
    output and multiplies the up GEMM's output by it as post-ops, inside the GEMMs: the
    intermediate activations are never written and re-read (~10% of a prefill MLP on this CPU)."""

    gate_packed: torch.Tensor | None = None
    up_packed: torch.Tensor | None = None
    triton = False  # silu(gate) * up as one Triton kernel (layers/triton_ops.py; the GPU path)

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.shard_sizes = (out_features // 2, out_features // 2)

    def pack_small(self, width: int, quantized: torch.Tensor | None = None) -> None:
        """Gate and up panels alternate, so the kernel finishes silu(gate) * up per panel pair."""
        weight = self.blocks if self.blocks is not None else quantized if quantized is not None else self.weight
        self.small = pack_swiglu(weight, width, self.bias, self.weight_scale)

    def pack(self, keep_dense: bool) -> None:
        if self.blocks_only():
            super().pack(keep_dense)
            return
        gate, up = self.weight.detach().chunk(2)
        self.gate_packed = torch.ops.mkldnn._reorder_linear_weight(gate.contiguous(), _PACK_HINT)
        self.up_packed = torch.ops.mkldnn._reorder_linear_weight(up.contiguous(), _PACK_HINT)
        self.gate_bias, self.up_bias = self.bias.chunk(2) if self.bias is not None else (None, None)
        if not keep_dense:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.active:  # adapter rows: their gate and up adapted first
            return self.lora.gate_up(self, x)
        return self._swiglu(x)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        if self.library is not None:  # the swiglu panels give silu(gate) * up
            return self._base(x)
        if self.gate_packed is not None:
            gate = torch.ops.mkldnn._linear_pointwise(x, self.gate_packed, self.gate_bias, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up_packed, self.up_bias, "mul")
        if self.triton:
            return triton_ops.silu_mul(F.linear(x, self.weight, self.bias))
        gate, up = F.linear(x, self.weight, self.bias).chunk(2, dim=-1)
        return F.silu(gate) * up
