"""The output layer and cross-entropy in blocks: F.cross_entropy's value and gradients, the logits never whole."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.training import output_loss as module
from pagedllm.training.output_loss import output_loss


@pytest.mark.parametrize("head_trains", [True, False])
def test_blockwise_loss_equals_cross_entropy_over_whole_logits(monkeypatch, head_trains):
    monkeypatch.setattr(module, "BLOCK_ELEMENTS", 3 * 300)  # 3 positions a block: 23 positions in 8 blocks
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    head.weight.requires_grad_(head_trains)
    hidden = torch.randn(23, 16, requires_grad=True)
    labels = torch.randint(0, 300, (23,))
    loss = output_loss(hidden, head, labels)
    loss.backward(torch.tensor(0.7))
    got = (hidden.grad.clone(), head.weight.grad.clone() if head_trains else None)
    hidden.grad, head.weight.grad = None, None
    reference = F.cross_entropy(head(hidden), labels)
    reference.backward(torch.tensor(0.7))
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(got[0], hidden.grad)
    if head_trains:
        torch.testing.assert_close(got[1], head.weight.grad)
    else:
        assert head.weight.grad is None


def test_without_gradients_it_is_cross_entropy_of_the_logits():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden, labels = torch.randn(5, 8), torch.randint(0, 50, (5,))
    with torch.no_grad():
        torch.testing.assert_close(output_loss(hidden, head, labels), F.cross_entropy(head(hidden), labels))
