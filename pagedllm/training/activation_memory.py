"""Activation memory as autograd holds it: the bytes a forward saves for its backward.

What context parallelism divides (each rank saves 1/cp of every sequence's activations) and what a
rank's activation budget is spent on. Counted once per storage (views share one), parameters left
out -- also FSDP's gathered copies, which are the module's parameters while its forward runs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor


def saved_activation_bytes(model: nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Run `forward()` (grad enabled) and return the bytes of the tensors autograd saved for backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        params = {id(p) for p in model.parameters()}  # now: FSDP swaps in the gathered ones around a forward
        if id(t) not in params and id(t._base) not in params:
            if isinstance(t, AsyncCollectiveTensor):  # an all-to-all's output (expert parallelism)
                t = t.trigger_wait()
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())
