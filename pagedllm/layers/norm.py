"""RMSNorm, computed exactly as transformers does (in fp32, weight applied after the cast back).

Written out rather than through `F.rms_norm`: on CPU the fused op gives the same bits but runs
17x slower on a 2048-token prefill (5.1 ms vs 0.30 ms for 2048 x 576, measured), and no faster
at decode sizes.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
