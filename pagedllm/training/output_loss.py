"""The output layer and its cross-entropy together, a block of positions at a time.

A fine-tune's loss is the mean, over the trained positions, of logsumexp(h W^T) - (h W^T)[label]
with W the [vocab, hidden] output matrix (SmolLM2: 49,152 x 576). Through the modules, the logits
of a micro-batch ([trained positions, vocab] in float32, ~120 MB for 600 positions), the
log-softmax autograd saves and the logits' gradient are the largest tensors of the step. Here the
positions go through in blocks of BLOCK_ELEMENTS / vocab rows; for each block, forward computes the
loss and at once its gradients (dh = (softmax - onehot) W / n, dW += (softmax - onehot)^T h / n),
so no more than one block's logits ever exist, and backward only scales the kept gradients by the
incoming one. The same arithmetic as F.cross_entropy in float32; only the summation order differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

BLOCK_ELEMENTS = 8 * 1024 * 1024  # logits per block: 32 MiB in float32


class LinearCrossEntropyFn(torch.autograd.Function):
    """mean_i CE(hidden_i W^T, labels_i); gradients for hidden and W computed in forward, block by block."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        rows = max(1, BLOCK_ELEMENTS // weight.shape[0])
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, rows):
            h, y = hidden[start:start + rows], labels[start:start + rows]
            logits = h @ weight.t()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' memory
            probs[torch.arange(len(y), device=y.device), y] -= 1
            probs.div_(n)
            if grad_hidden is not None:
                torch.mm(probs, weight, out=grad_hidden[start:start + rows])
            if grad_weight is not None:
                grad_weight.addmm_(probs.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden.mul_(grad) if grad_hidden is not None else None,
                grad_weight.mul_(grad) if grad_weight is not None else None, None)


def output_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` against `labels` (no ignored entries: the caller keeps the
    trained positions). Blockwise for a plain float32 head outside autocast; otherwise the logits
    are made whole and upcast, as before."""
    plain = (type(head) is torch.nn.Linear and head.bias is None and hidden.dtype == head.weight.dtype == torch.float32
             and not torch.is_autocast_enabled(hidden.device.type)
             and not isinstance(head.weight, DTensor) and not isinstance(hidden, DTensor))  # sharded: the modules
    if plain and torch.is_grad_enabled():
        return LinearCrossEntropyFn.apply(hidden, head.weight, labels)
    return F.cross_entropy(head(hidden).float(), labels)
