"""RMSNorm's fast fp32 path against transformers' formula, bit for bit."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.norm import RMSNorm


@pytest.mark.parametrize("size", [16, 64, 576])
@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
def test_fp32_path_gives_the_formulas_bits(size, rows):
    gen = torch.Generator().manual_seed(size * rows)
    norm = RMSNorm(size, 1e-6)
    norm.weight.data = torch.randn(size, generator=gen)
    x = torch.randn(rows, size, generator=gen) * 3
    assert torch.equal(norm(x), norm.reference(x))


def test_gradients_match_the_formula():
    norm = RMSNorm(32, 1e-5)
    x = torch.randn(5, 32, requires_grad=True)
    (norm(x) ** 2).sum().backward()
    fast_x, fast_w = x.grad.clone(), norm.weight.grad.clone()
    x.grad, norm.weight.grad = None, None
    (norm.reference(x) ** 2).sum().backward()
    torch.testing.assert_close(fast_x, x.grad)
    torch.testing.assert_close(fast_w, norm.weight.grad)

