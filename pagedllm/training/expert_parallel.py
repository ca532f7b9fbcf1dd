"""Expert parallelism: a moe's experts sharded over the `ep` mesh dimension, tokens moved by all-to-all.

As in torchtitan, the EP ranks are data-parallel ranks too (the `dp` dimension is `dp_mod_ep` x `ep`):
each rank routes its own tokens, top-k token choice with no capacity limit (no token is dropped),
then

1. dispatch: every (token, chosen expert) pair, sorted by expert, goes to the rank holding that
   expert -- one `all_to_all_single` of the per-expert counts, one autograd-aware all-to-all of the
   rows (torch.distributed._functional_collectives);
2. the rank runs its E / ep experts over the rows it received (from every EP rank);
3. combine: the outputs go back by the reverse all-to-all and are summed into their tokens with the
   router weights.

Each rank keeps only its experts (`experts.N` keeps its global N, so checkpoints and Hugging Face
names are the same at any EP size). Their gradients hold the contributions of the whole EP group's
tokens; FSDP then shards and reduces them over `dp_mod_ep` (the ranks holding the same experts) with
the divide factor of the whole data-parallel group, so they equal the single-process gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh


class LocalExperts(nn.ModuleDict):
    """This rank's experts, keyed by their global index. Its forward (one call per MoE layer, so
    FSDP's hooks gather and free the shard around it) runs every local expert, also on no rows:
    every expert parameter then has a gradient on every rank, as FSDP's reduce-scatter needs."""

    def forward(self, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
        for i, expert in enumerate(self.values()):
            (index,) = torch.where(local_expert == i)
            out = out.index_add(0, index, expert(rows.index_select(0, index)))
        return out


class AllToAllDispatch:
    """Sends routed rows to their experts' ranks and their outputs back (see the module docstring)."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup) -> None:
        self.group, self.size = group, group.size()
        self.num_experts, self.local = num_experts, num_experts // self.size

    def __call__(self, flat: torch.Tensor, top_index: torch.Tensor, top_weights: torch.Tensor,
                 experts: LocalExperts) -> torch.Tensor:
        top_k = top_index.shape[1]
        expert_of_pair = top_index.reshape(-1)
        order = expert_of_pair.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // top_k
        counts = torch.bincount(expert_of_pair, minlength=self.num_experts)
        received = torch.empty_like(counts)  # [source rank, local expert]: rows each source sends
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, self.local)
        send_splits = counts.view(self.size, self.local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(flat.index_select(0, tokens), recv_splits, send_splits, self.group)
        local_expert = torch.arange(self.local, device=flat.device).repeat(self.size).repeat_interleave(received.reshape(-1))
        out = all_to_all_single_autograd(experts(rows, local_expert), send_splits, recv_splits, self.group)
        weights = top_weights.reshape(-1).index_select(0, order)
        return torch.zeros_like(flat).index_add(0, tokens, out * weights[:, None])


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    from pagedllm.training.model import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's E / ep experts in every MoE block and route through the all-to-all."""
    group = ep_mesh.get_group()
    rank, size = group.rank(), group.size()
    for block in moe_blocks(model):
        num_experts = len(block.experts)
        local = num_experts // size
        keep = range(rank * local, (rank + 1) * local)
        block.experts = LocalExperts({str(e): block.experts[e] for e in keep})
        block.dispatch = AllToAllDispatch(num_experts, group)


def shard_experts(model: nn.Module, expert_dp_mesh: DeviceMesh, fsdp_options: dict, divide_factor: int) -> None:
    """FSDP over the ranks that hold the same experts; gradients divided by the whole data-parallel
    size (not this mesh's), as a sum reduction -- which gloo runs too (no NCCL PreMulSum).

    On a one-rank mesh (ep = data_parallel_size, e.g. ep 2 x tp 2 on 4 ranks) nothing is
    communicated, and torch 2.13's FSDP divides a forced sum twice there (once when copying the
    unreduced gradient, once as the post-divide factor): the default reduction then divides once."""
    from torch.distributed.fsdp import fully_shard

    for block in moe_blocks(model):
        if isinstance(block.experts, LocalExperts):
            fully_shard(block.experts, **{**fsdp_options, "mesh": expert_dp_mesh})
            block.experts.set_gradient_divide_factor(float(divide_factor))
            if expert_dp_mesh.size() > 1:
                block.experts.set_force_sum_reduction_for_comms(True)


def expert_parameters(parts: list[nn.Module]) -> set[int]:
    """ids of the parameters that live on one EP rank only (their norm is summed over the EP group)."""
    return {id(p) for part in parts for block in moe_blocks(part) if isinstance(block.experts, LocalExperts)
            for p in block.experts.parameters()}
