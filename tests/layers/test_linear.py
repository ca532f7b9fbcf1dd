"""Packed linear: matches F.linear to float rounding, and is batch-invariant bit for bit."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, packing_available


def test_packed_linear_matches_dense_and_is_batch_invariant():
    assert packing_available(torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=True)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack(keep_dense=False)
    assert layer.weight.numel() == 0  # the dense copy is gone
    x = torch.randn(300, 96)
    with torch.inference_mode():
        full = layer(x)
        assert torch.allclose(full, F.linear(x, weight, bias), atol=1e-5)
        for rows in (1, 2, 5, 17, 64, 299):
            assert torch.equal(layer(x[:rows]), full[:rows])  # same bits whatever the batch size
