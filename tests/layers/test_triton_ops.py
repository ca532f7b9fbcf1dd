"""The Triton element-wise kernels (RMSNorm, rotary, SiLU-up) against the PyTorch formulas they
replace: float32 to float rounding (a sum's order, an exp's last bit, a fused multiply-add), bf16
to one bf16 step of the operands in a few elements (every intermediate the formula stores in
bf16 is rounded there too, but on an H100 2.6-3.1 % of rotary's outputs still differed by one
step, as if the compiler had contracted a product and a sum across the rounding). The engine's
bf16 parity against transformers holds with them (tests/engine/test_cuda.py). On CPU through
Triton's interpreter; the CUDA cases run under `pytest -m cuda`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import triton_ops
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.layers.triton_attention import triton

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
_ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
# Triton's interpreter converts to bf16 by truncating (a GPU rounds to nearest), so bf16 is
# checked on CUDA only.
CASES = [("cpu", torch.float32), pytest.param("cuda", torch.float32, marks=_ON_CUDA),
         pytest.param("cuda", torch.bfloat16, marks=_ON_CUDA)]


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, atol=scale * 2**-8, rtol=2**-7)  # one bf16 step of the operands
        assert (got != expected).float().mean() < 0.05  # in a few elements


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("size", [64, 576, 100])
def test_rms_norm_matches_the_module(device, dtype, size):
    norm = RMSNorm(size, 1e-5).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size) * 0.5 + 1)
    x = torch.randn(9, size + 8, device=device, dtype=dtype)[:, :size] * 3  # a strided view
    expected = norm(x)
    got = triton_ops.rms_norm(x, norm.weight, 1e-5)
    assert_close(got, expected)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("heads,head_dim", [(6, 16), (5, 64), (3, 24)])
def test_rotary_matches_apply_rotary(device, dtype, heads, head_dim):
    rope_module = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype).to(device)
    positions = torch.tensor([0, 5, 511, 77, 300], device=device)
    rope = rope_module(positions)
    qkv = torch.randn(5, heads + 2, head_dim, device=device, dtype=dtype)
    qk = qkv[:, :heads]  # a strided view, as the model passes it
    assert_close(triton_ops.rotary(qk, rope), apply_rotary(qk, rope))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("width", [128, 3000])
def test_silu_mul_matches_the_formula(device, dtype, width):
    x = torch.randn(7, 2 * width, device=device, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    assert_close(triton_ops.silu_mul(x), F.silu(gate) * up)
