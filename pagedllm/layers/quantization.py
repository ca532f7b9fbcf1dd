"""Weight-only quantization: int8 per output channel, or llama.cpp's blocks of 32 (Q4_0, Q4_1,
Q8_0) kept as GGUF stores them.

int8: each output channel c of a weight W [n, k] gets scale_c = max_k |W[c, k]| / 127 and
q[c, k] = round(W[c, k] / scale_c) in [-127, 127], so |W - q * scale| <= scale / 2 everywhere:
the quality class of llama.cpp's q8_0, which uses the same rule per block of 32 weights rather
than per channel. Computed at load time from an ordinary fp32 (or bf16/fp16) checkpoint.

Blocks: every 32 consecutive inputs of a row share an fp16 scale d (and for Q4_1 an fp16 min m):
Q8_0 w = d q (q int8), Q4_0 w = d (q - 8) and Q4_1 w = d q + m (q 4 bits). A GGUF file's blocks of
these types are kept bit for bit (the C kernel reads them, layers/small_matmul.py); "q4"
quantizes a folder's weights to Q4_1 at load, as llama.cpp's quantizer does (gguf.quants).
Activations and the KV cache stay fp32 either way: only the weights' bytes, what a decode step
spends its time reading, shrink (4-bit: 5 bits a weight with the scales, 6.4x fewer than fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# "gguf": keep a GGUF file's own blocks; "none": dequantize everything (a GGUF's reference path).
QUANTIZATION_METHODS = ("int8", "q4", "gguf", "none")
BLOCK = 32
KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scale float32 [n]); an all-zero channel gets scale 1 (its q is 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


@dataclass
class Blocks:
    """A weight [n, k] as GGUF blocks: `rows` uint8 [n, k / 32 * block bytes], one row per output channel."""

    kind: str  # Q4_0, Q4_1 or Q8_0
    rows: np.ndarray

    def __post_init__(self) -> None:
        if self.kind not in KEPT_TYPES:
            raise ValueError(f"block type must be one of {KEPT_TYPES}, got {self.kind!r}")

    @property
    def qtype(self):
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType[self.kind]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k] the blocks stand for (exactly the values the C kernel uses)."""
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(self.rows, self.qtype), dtype=np.float32))


def quantize_blocks(weight: torch.Tensor, kind: str) -> Blocks:
    """`weight` [n, k] (k a multiple of 32) quantized to `kind` blocks by llama.cpp's rules."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if weight.shape[-1] % BLOCK:
        raise ValueError(f"block quantization needs a multiple of {BLOCK} inputs, got {weight.shape[-1]}")
    values = weight.detach().float().cpu().numpy()
    return Blocks(kind, quantize(values, GGMLQuantizationType[kind]))


def concat_rows(parts: list[Blocks]) -> Blocks:
    """The blocks of a fused projection (q|k|v, gate|up) from its parts' blocks, one type for all:
    parts of different types are all quantized to Q8_0 from their values (a mixed file)."""
    kinds = {p.kind for p in parts}
    if len(kinds) > 1:
        parts = [quantize_blocks(p.dequantize(), "Q8_0") for p in parts]
    return Blocks(parts[0].kind, np.concatenate([p.rows for p in parts]))
