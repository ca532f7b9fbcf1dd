"""The lean elementwise ops (training/lean_ops.py): the modules' forward bits, their gradients, and
fewer bytes saved for backward -- the reason they exist."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.training.activation_memory import saved_activation_bytes
from pagedllm.training.config import ModelShapeConfig
from pagedllm.training.lean_ops import rms_norm, silu_mul, swiglu_down
from pagedllm.training.model import DecoderLayer


def _leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> tuple[torch.Tensor, ...]:
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, upstream)


def test_swiglu_down_equals_the_modules_and_saves_only_gate_and_up():
    gate, up = _leaves((2, 8, 48), (2, 8, 48))
    down = nn.Linear(48, 16, bias=False)
    lean = swiglu_down(gate, up, down)
    plain = down(F.silu(gate) * up)
    assert torch.equal(lean, plain)
    for a, b in zip(_grads(lean, [gate, up, down.weight]), _grads(plain, [gate, up, down.weight])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    saved = saved_activation_bytes(down, lambda: swiglu_down(gate, up, down))
    assert saved == 2 * gate.numel() * 4  # gate and up: neither silu(gate) nor the product


def test_silu_mul_gradients_are_the_modules_bits():
    gate, up = _leaves((3, 40), (3, 40))
    lean, plain = silu_mul(gate, up), F.silu(gate) * up
    assert torch.equal(lean, plain)
    for a, b in zip(_grads(lean, [gate, up]), _grads(plain, [gate, up])):
        assert torch.equal(a, b)


def test_swiglu_down_keeps_the_modules_for_a_linear_that_is_not_plain():
    """A biased (or wrapped) down projection takes the modules' path: its own autograd, same values."""
    gate, up = _leaves((4, 24), (4, 24))
    down = nn.Linear(24, 8, bias=True)
    torch.testing.assert_close(swiglu_down(gate, up, down), down(F.silu(gate) * up), rtol=0, atol=0)
    assert swiglu_down(gate, up, down).grad_fn.name() == "AddmmBackward0"


def test_rms_norm_forward_bits_and_gradients():
    x, weight = _leaves((2, 5, 64), (64,))
    lean = rms_norm(x, weight, 1e-5)
    plain = F.rms_norm(x, (64,), weight, 1e-5)
    assert torch.equal(lean, plain)
    for a, b in zip(_grads(lean, [x, weight]), _grads(plain, [x, weight])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert rms_norm(x, weight, 1e-5) is None  # inference: the engine's module path


def test_rms_norm_gradient_against_float64():
    """The written-out backward against autograd in float64 (a wrong term is far off, not 1e-5)."""
    x, weight = _leaves((3, 32), (32,), seed=4)
    lean = _grads(rms_norm(x, weight, 1e-6), [x, weight])
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = _grads(x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64, [x64, w64])
    for a, b in zip(lean, exact):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


SMOL = ModelShapeConfig(architecture="llama", hidden_size=576, intermediate_size=1536, num_layers=1,
                        num_attention_heads=9, num_kv_heads=3, vocab_size=64)


@pytest.mark.parametrize("packed", [False, True])
def test_a_smollm2_layer_saves_under_30_mib_at_a_micro_batch(packed):
    """A SmolLM2 layer at 4 x 256 tokens: 48 MiB saved through the plain modules (gate, silu, up,
    product; normalised rows; K/V repeated to 9 heads), ~28.5 MiB with the lean ops and grouped
    attention. Fails when any of them falls back to the modules."""
    torch.manual_seed(0)
    layer = DecoderLayer(SMOL)
    x = torch.randn(4, 256, 576, requires_grad=True)
    segments = torch.arange(256).div(60, rounding_mode="floor").expand(4, 256).contiguous() if packed else None
    saved = saved_activation_bytes(layer, lambda: layer(x) if segments is None else layer(x, segments))
    assert saved < 30 * 2**20, f"{saved / 2**20:.1f} MiB"
