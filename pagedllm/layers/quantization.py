"""Weight-only int8 quantization: per-output-channel symmetric scales, computed at load time
from an ordinary fp32 (or bf16/fp16) checkpoint.

Each output channel c of a weight W [n, k] gets scale_c = max_k |W[c, k]| / 127 and
q[c, k] = round(W[c, k] / scale_c) in [-127, 127], so |W - q * scale| <= scale / 2 everywhere:
the quality class of llama.cpp's q8_0, which uses the same rule per block of 32 weights rather
than per channel. Activations and the KV cache stay fp32; only the weights' bytes — what a
decode step spends its time reading — shrink fourfold.
"""
from __future__ import annotations

import torch

QUANTIZATION_METHODS = ("int8",)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scale float32 [n]); an all-zero channel gets scale 1 (its q is 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]
