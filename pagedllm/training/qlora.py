"""QLoRA: the frozen base weights stay in llama.cpp's blocks (Q4_0, Q4_1, Q8_0: a GGUF's own, or a
folder's weights quantized to Q4_1), dequantized on the fly in forward and again in backward;
only the LoRA pairs train.

Memory is the point: a 4-bit weight is 5 bits with its scales (Q4_1), 6.4x less than the float32
weight a LoRA base keeps, and no dense copy outlives one layer's matmul -- `BlockLinearFn` saves the
blocks, not the dequantized weight, for backward. The input gradient is dy @ W with W dequantized
again; the blocks get no gradient (they are not parameters). Dequantization here is torch code,
the same arithmetic as gguf.quants (what the engine's reference path uses), checked against it in
the tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.adapters.peft_format import LoraSettings
from pagedllm.layers.quantization import BLOCK, Blocks, quantize_blocks
from pagedllm.training.lora import LoraPair

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def dequantize_blocks(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 [n, k] from uint8 block rows [n, k / 32 * block bytes]: Q8_0 w = d q; Q4_0 w = d (q - 8);
    Q4_1 w = d q + m, the 4-bit q of element j in the low nibble of byte j, of element j + 16 in its high nibble."""
    n = rows.shape[0]
    blocks = rows.view(n, -1, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).view(n, -1)
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    if kind == "Q4_0":
        return (d * (q - 8)).view(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).view(n, -1)


class BlockLinearFn(torch.autograd.Function):
    """y = x W^T with W dequantized from blocks in forward and again in backward (nothing dense is saved)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.kind = kind
        return F.linear(x, dequantize_blocks(rows, kind).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad @ dequantize_blocks(rows, ctx.kind).to(grad.dtype), None, None


class QLoraLinear(nn.Module):
    """A linear layer whose frozen weight is kept as blocks (a non-persistent buffer: checkpoints
    never hold the base), plus a LoRA pair. Its float bias, if any (qwen2), stays a frozen parameter."""

    def __init__(self, blocks: Blocks, bias: nn.Parameter | None, settings: LoraSettings) -> None:
        super().__init__()
        rows = torch.from_numpy(blocks.rows.copy())
        self.kind = blocks.kind
        self.register_buffer("blocks", rows, persistent=False)
        self.out_features = rows.shape[0]
        self.in_features = rows.shape[1] // BLOCK_BYTES[self.kind] * BLOCK
        self.bias = bias
        if bias is not None:
            bias.requires_grad_(False)
        self.adapter = LoraPair(self.in_features, self.out_features, settings)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_blocks(self.blocks, self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = BlockLinearFn.apply(x, self.blocks, self.kind)
        if self.bias is not None:
            y = y + self.bias
        return y + self.adapter(x)


def qlora_layer_factory(file_blocks: dict[str, Blocks], default_kind: str = "Q4_1"):
    """make_layer for lora.apply_lora: a layer the GGUF stores as blocks keeps them; any other
    (a folder's weights, or a float tensor in the file) is quantized to `default_kind` here."""

    def make(path: str, linear: nn.Linear, settings: LoraSettings) -> QLoraLinear:
        blocks = file_blocks.get(f"{path}.weight") or quantize_blocks(linear.weight.detach(), default_kind)
        return QLoraLinear(blocks, linear.bias, settings)

    return make
