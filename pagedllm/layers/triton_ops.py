"""The small element-wise ops of a decoder layer as single Triton kernels, for GPUs.

On a GPU a decode step of a small model is mostly tiny kernels: written out in PyTorch, RMSNorm
is seven (cast, square, mean, rsqrt, multiply, cast back, weight), rotary five and SiLU·up two,
about two thirds of the ~530 kernels of a Llama-3.2-1B step. Even replayed from a CUDA graph each
costs a few microseconds of GPU time, so at batch 1 they take longer than streaming the weights.
Each op here is one kernel that rounds where the PyTorch formula rounds (every intermediate the
formula stores in the activation dtype is rounded to it here too), so bf16 results match
transformers' formulas up to the order of the norm's sum.

Used when the Triton backend is on (`ModelRunner`, CUDA by default); Triton's interpreter runs
them on CPU tensors for tests.
"""
from __future__ import annotations

import torch

from pagedllm.layers.triton_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr, ROUND: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
        y = x * rstd
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        if ROUND:  # transformers: weight * (x * rstd).to(dtype), a product of two half-precision values
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (y * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_c, stride_s, stride_ot, stride_oh,
                       HEADS, HALF, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
        token = tl.program_id(0)
        heads = tl.arange(0, H_PAD)[:, None]
        cols = tl.arange(0, HALF_PAD)[None, :]
        mask = (heads < HEADS) & (cols < HALF)
        base = x_ptr + token * stride_xt + heads * stride_xh + cols
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        c1 = tl.load(cos_ptr + token * stride_c + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + token * stride_c + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + token * stride_s + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + token * stride_s + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        # x * cos + swap_halves(x) * sin, each product rounded to x's dtype as PyTorch stores it
        a1 = (x1.to(tl.float32) * c1).to(dtype).to(tl.float32)
        a2 = (x2.to(tl.float32) * c2).to(dtype).to(tl.float32)
        b1 = (x2.to(tl.float32) * s1).to(dtype).to(tl.float32)
        b2 = (x1.to(tl.float32) * s2).to(dtype).to(tl.float32)
        out = out_ptr + token * stride_ot + heads * stride_oh + cols
        tl.store(out, (a1 + b1).to(dtype), mask=mask)
        tl.store(out + HALF, (a2 + b2).to(dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu's result is stored in the dtype
        tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] -> RMSNorm(x) * weight, as layers/norm.py computes it, in one kernel."""
    rows, size = x.shape
    out = torch.empty((rows, size), dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), size, eps,
                                  BLOCK=triton.next_power_of_2(size), ROUND=x.dtype != torch.float32)
    return out


def rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """layers/rotary.py's apply_rotary in one kernel: x [T, heads, D] (q and k together), rope's
    rows [T, 1, D] (the sign of rotate_half lives in the sin table)."""
    tokens, heads, dim = x.shape
    cos, sin = (table.reshape(tokens, dim) for table in rope)
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        half = dim // 2
        _rotary_kernel[(tokens,)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                  out.stride(0), out.stride(1), heads, half,
                                  H_PAD=triton.next_power_of_2(heads), HALF_PAD=triton.next_power_of_2(half))
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate | up) -> silu(gate) * up: [T, I], in one kernel."""
    rows, width = x.shape
    half = width // 2
    out = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(half))
        _silu_mul_kernel[(rows, triton.cdiv(half, block))](x, out, x.stride(0), out.stride(0), half, BLOCK=block)
    return out
