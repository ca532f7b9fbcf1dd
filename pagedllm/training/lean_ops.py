"""A decoder layer's elementwise ops with fewer saved activations: recompute what is cheap.

Autograd through the modules saves every intermediate an op needs: a SwiGLU feed-forward keeps the
gate, silu(gate), up and their product (4 x intermediate floats a token), an RMSNorm keeps its
input, the normalised rows and the output. At a fine-tune's micro-batch (4 x 256 tokens of
SmolLM2) that is ~48 MiB a layer, 1.4 GB for 30 layers, the largest share of a full fine-tune's
peak after the weights, gradients and AdamW's state. Here:

* `swiglu_down`: down(silu(gate) * up) saves only gate and up (and the weight it already had);
  backward recomputes silu and the product -- one elementwise pass -- for the down projection's
  weight gradient and the gate/up gradients.
* `silu_mul`: silu(gate) * up alone, when the down projection is not a plain linear (a LoRA
  linear or a tensor-parallel shard keeps its own input): saves gate and up, not silu(gate).
* `rms_norm`: saves the input and 1/rms, not the normalised rows (recomputed in backward).

Forward is the same arithmetic as the modules (the same bits: tests/training/test_lean_ops.py);
gradients are the same formulas, with the RMSNorm's written out (its summation order differs).
Together they cut a SmolLM2 layer's saved activations from ~48 to ~33 MiB at that micro-batch
(measured in docs/benchmarks.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def _plain(*tensors: torch.Tensor) -> bool:
    """float32 plain tensors outside autocast: the case these functions compute exactly as the
    modules do. Anything else (DTensor shards, autocast's casts) keeps the modules' own ops."""
    return (all(t.dtype == torch.float32 and not isinstance(t, DTensor) for t in tensors)
            and not torch.is_autocast_enabled(tensors[0].device.type))


class SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class SwiGLUDownFn(torch.autograd.Function):
    """(silu(gate) * up) W^T for a plain bias-free linear W, the product recomputed in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate) * up, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[2]:  # as autograd's mm: input^T grad, transposed
            grad_weight = (silu * up).reshape(-1, up.shape[-1]).t().mm(grad2d).t()
        grad_act = grad2d.mm(weight).view(up.shape)
        return torch.ops.aten.silu_backward(grad_act * up, gate), grad_act * silu, grad_weight


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and _plain(gate, up):
        return SiluMulFn.apply(gate, up)
    return F.silu(gate) * up


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, down: nn.Module) -> torch.Tensor:
    """down(silu(gate) * up); the lean function when `down` is a plain float32 nn.Linear without bias."""
    weight = getattr(down, "weight", None)
    if (torch.is_grad_enabled() and type(down) is nn.Linear and down.bias is None and not down._forward_hooks
            and not down._forward_pre_hooks and _plain(gate, up, weight)):
        return SwiGLUDownFn.apply(gate, up, weight)
    return down(silu_mul(gate, up))


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))  # F.rms_norm's own arithmetic
        ctx.save_for_backward(x, rstd, weight)
        return x.mul(rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        grad_normed = grad * weight
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - normed * mean(g * normed))
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The lean RMSNorm for plain float32 tensors with grad enabled; None: use the module's own."""
    if torch.is_grad_enabled() and _plain(x, weight):
        return RMSNormFn.apply(x, weight, eps)
    return None
