"""Tied input and output embeddings (SmolLM2, Qwen2-0.5B...) under tensor and pipeline parallelism.

A tied model has ONE matrix [vocab, hidden] used twice: as the embedding table and as lm_head.

* Tensor parallelism: the embedding is vocabulary-parallel (RowwiseParallel on nn.Embedding shards
  dim 0) and lm_head is column-parallel (ColwiseParallel on nn.Linear shards its output dim, also dim
  0 of the [vocab, hidden] weight): both want the same Shard(0) DTensor. `parallelize_module`
  distributes each module's parameters separately, which would untie them; `retie` makes lm_head use
  the embedding's DTensor Parameter again, so one gradient accumulates both uses (as torchtitan does).
* Pipeline parallelism: the embedding lives on the first stage and lm_head on the last, two copies
  of one weight on different ranks. As in Megatron-LM, both start equal (every rank builds the same
  model from the seed), their gradients are summed over a group of those two ranks after every
  backward (`TiedStageGradients.all_reduce`), and both take the same optimizer step, so they stay
  equal. The gradient-norm clip counts the weight once: the last stage's copy is left out of the norm
  (`is_duplicate`), though it is clipped by the same factor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

DUPLICATE_FLAG = "_pagedllm_tied_duplicate"


def retie(model: nn.Module) -> None:
    """Point lm_head at the embedding's (already parallelised) Parameter, when the model ties them and
    holds both (one process, or tensor parallel without pipeline stages)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not cfg.tie_word_embeddings:
        return
    if model.model.embed_tokens is None or model.lm_head is None:
        return
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    if isinstance(embed, DTensor) and isinstance(head, DTensor) and embed.placements != head.placements:
        raise ValueError(f"tied weights with different placements: embedding {embed.placements}, lm_head {head.placements}")
    model.lm_head.weight = embed


def is_duplicate(param: torch.Tensor) -> bool:
    """The last pipeline stage's copy of a tied weight: its gradient equals the first stage's after
    the all-reduce, so a global norm must not count it twice."""
    return getattr(param, DUPLICATE_FLAG, False)


class TiedStageGradients:
    """The first and the last pipeline stage's copies of the tied embedding, and the group of the two
    ranks (same data/tensor-parallel coordinate) that holds them."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self.params, self.group = params, group

    @classmethod
    def build(cls, parts: list[nn.Module], stage_indices: list[int], num_stages: int, mesh: DeviceMesh) -> "TiedStageGradients":
        """Collective over the world: every rank creates every (first, last)-stage group, in the same order."""
        params: list[nn.Parameter] = []
        for part, index in zip(parts, stage_indices):
            if index == 0:
                params.append(part.model.embed_tokens.weight)
            if index == num_stages - 1:
                setattr(part.lm_head.weight, DUPLICATE_FLAG, True)
                params.append(part.lm_head.weight)
        # a LoRA fine-tune freezes the embedding: no gradient to sum (the group is still made: collective)
        return cls([p for p in params if p.requires_grad], _first_last_group(mesh))

    def all_reduce(self) -> None:
        """Sum the two copies' gradients (each already reduced over data parallelism by FSDP): the
        gradient the single tied weight gets in one process."""
        if self.group is None or not self.params:
            return
        for param in self.params:
            grad = param.grad
            if grad is None:
                raise RuntimeError("a tied embedding copy has no gradient after backward")
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, group=self.group)


def _first_last_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """For this rank's (dp, tp) coordinate, the group {pp rank 0, pp rank last}: the first and the last
    stage. new_group is collective, so every rank creates all of them; this rank keeps its own."""
    ranks = mesh.mesh  # (pp, dp, tp) global ranks
    pp = ranks.shape[0]
    mine = None
    me = dist.get_rank()
    for coord in ranks[0].flatten().tolist():
        index = (ranks[0] == coord).nonzero()[0].tolist()
        pair = [coord, int(ranks[(pp - 1, *index)])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine
