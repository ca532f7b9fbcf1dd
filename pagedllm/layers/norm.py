"""RMSNorm, computed exactly as transformers does (in fp32, weight applied after the cast back).

For fp32 inputs this is one `F.rms_norm` call, which gives the same bits as transformers'
formula (checked in tests/layers/test_norm.py) and is one op instead of six: after a linear has
streamed its weights through the caches, each small op pays for the dispatcher's own cache
misses again, so at decode sizes fewer ops is what makes it faster. Other dtypes use the formula
written out, so the cast back happens where transformers does it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import triton_ops


class RMSNorm(nn.Module):
    triton = False  # one Triton kernel instead (layers/triton_ops.py; the GPU path)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton and x.dim() == 2 and x.stride(-1) == 1:
            return triton_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm.forward."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
