"""A MoE's load-balancing loss under pipeline parallelism.

In one process the objective is cross_entropy + router_aux_loss_coef x (mean of the MoE layers' balance
losses), all backpropagated from one scalar. A pipeline runs backward from the last stage's loss only,
and the balance losses of the layers on earlier stages are not part of it. Megatron-LM's answer
(MoEAuxLossAutoScaler), used here: each MoE layer's output goes through an identity whose backward also
hands its balance loss the gradient it has in the single-process objective, coef / num_layers (times
the FP16 loss scale when there is one; the schedule divides every gradient by the microbatch count, as
the single process divides the objective). Forward values are unchanged: the reported loss is the
cross entropy, as without a pipeline.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _BalanceLossGradient(torch.autograd.Function):
    """Identity on the layer's output; in backward, d(objective)/d(balance loss) for the balance loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, balance_loss: torch.Tensor, weight: Callable[[], float]) -> torch.Tensor:
        ctx.weight = weight
        ctx.loss_shape, ctx.loss_dtype = balance_loss.shape, balance_loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_loss = torch.full(ctx.loss_shape, ctx.weight(), dtype=ctx.loss_dtype, device=grad_output.device)
        return grad_output, grad_loss, None


def add_balance_loss_gradients(part: nn.Module, coef: float, num_moe_layers: int, loss_scale: Callable[[], float]) -> int:
    """Hook every MoE layer of this pipeline stage; returns how many were hooked."""
    weight = lambda: coef / num_moe_layers * loss_scale()  # noqa: E731 (read at backward: the FP16 scale moves)
    hooked = 0
    for layer in part.model.layers.values():
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None:
            continue

        def hook(module, args, output, weight=weight):
            if not torch.is_grad_enabled() or module.aux_loss is None:
                return output
            return _BalanceLossGradient.apply(output, module.aux_loss, weight)

        moe.register_forward_hook(hook)
        hooked += 1
    return hooked
