"""Rotary position embeddings (default, linear and Llama-3.x scaling), cached per position.

The cos/sin table is built once for every position up to max_position with the same float32
arithmetic transformers uses, so rotated q/k match the reference bit for bit in fp32.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed, short ones kept."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


Rope = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding(nn.Module):
    """Holds the tables; `forward(positions)` looks up a step's rows once for every layer."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, dtype: torch.dtype):
        super().__init__()
        device = torch.empty(0).device  # the ambient device (a `with torch.device(...)` block's)
        with torch.device("cpu"):  # (on the meta device, these ops imported torch._dynamo: ~1.5 s of start-up)
            inv_freq = _inv_freq(head_dim, theta, scaling)
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # transformers' layout
            sin = emb.sin()
            half = head_dim // 2
            cos = emb.cos().to(dtype)
            # rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: the sign lives in the table.
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate x: [T, heads, D] (q and k may be passed together as one tensor). Bit for bit this
    is transformers' `x * cos + rotate_half(x) * sin`: negating a factor is exact."""
    cos, sin = rope
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
