"""LoRA pairs under tensor parallelism: the pair sharded to match the projection it sits beside.

torch's ColwiseParallel / RowwiseParallel know an nn.Linear's weight and bias only (ColwiseParallel
would try to register the pair's `adapter.lora_A.weight` as a parameter of the projection itself).
For y = W x + s B A x, with W [out, in]:

* column-parallel W (q/k/v/gate/up: Shard(0), this rank's output features): B [out, r] is cut the same
  way, Shard(0); A [r, in] is replicated, each rank computes the whole A x. A's gradient is a sum
  over the ranks' output features, which DTensor reduces.
* row-parallel W (o/down: Shard(1), this rank's input features, the output a partial sum): A is cut
  the same way, Shard(1), so A x is a partial sum too; B is replicated. B (A x) stays a partial sum
  and joins the projection's, reduced once by RowwiseParallel's output layout.

So each rank holds 1/tp of the projection and of one of the pair's factors, and the result equals the
unsharded adapted layer. The frozen base keeps requires_grad=False through the distribution.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pagedllm.training.lora import LoraLinear


def _partition(placements: dict[str, tuple[Placement, Placement | None]], name: str, module: nn.Module,
               mesh: DeviceMesh) -> None:
    """`distribute_module` calls this for the LoraLinear ("") and for each of its submodules by path:
    the (weight, bias) placements of the ones named in `placements`."""
    if name not in placements:
        return
    for attr, placement in zip(("weight", "bias"), placements[name]):
        param = getattr(module, attr, None)
        if param is not None and placement is not None:
            module.register_parameter(attr, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                         requires_grad=param.requires_grad))


class ColwiseLoraParallel(ColwiseParallel):
    """ColwiseParallel for a LoraLinear: W, bias and B Shard(0), A replicated."""

    PLACEMENTS = {"": (Shard(0), Shard(0)), "adapter.lora_A": (Replicate(), None), "adapter.lora_B": (Shard(0), None)}

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _partition(self.PLACEMENTS, name, module, device_mesh)


class RowwiseLoraParallel(RowwiseParallel):
    """RowwiseParallel for a LoraLinear: W and A Shard(1), bias and B replicated."""

    PLACEMENTS = {"": (Shard(1), Replicate()), "adapter.lora_A": (Shard(1), None), "adapter.lora_B": (Replicate(), None)}

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _partition(self.PLACEMENTS, name, module, device_mesh)


def lora_aware(style: ColwiseParallel | RowwiseParallel, module: nn.Module) -> ColwiseParallel | RowwiseParallel:
    """`style` for a plain projection; its LoRA counterpart (same layouts) when `module` carries a pair."""
    if not isinstance(module, LoraLinear):
        return style
    kind = ColwiseLoraParallel if isinstance(style, ColwiseParallel) else RowwiseLoraParallel
    lora_style = kind.__new__(kind)
    lora_style.__dict__.update(style.__dict__)  # the same input/output layouts and use_local_output
    return lora_style
