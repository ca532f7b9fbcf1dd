"""Mixture-of-experts feed-forward: top-k routing, then the experts computed grouped by expert.

Every (token, chosen expert) pair is sorted by expert, so each expert that got tokens runs one
matmul over all of them; `F.grouped_mm` does all experts' matmuls in one call from a tensor of
group offsets, so nothing about the routing has to come back to the host (a Python loop over
experts would read the per-expert token counts every layer, a device synchronisation on a GPU).
Expert weights are stacked: `w13` [E, 2I, H] holds each expert's gate and up projections, `w2`
[E, H, I] its down projection, filled by the loader from the checkpoint's per-expert tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# F.grouped_mm wants every stride a multiple of 16 bytes.
_ALIGN_BYTES = 16


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top k; Mixtral (and Qwen with norm_topk_prob)
    renormalise the kept weights to sum to 1. Returns (weights [T, k] fp32, expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    # Tensor parallelism splits each expert's intermediate width: the rows of a checkpoint's gate
    # and up tensors, the columns of its down tensor (see models/loader.py).
    tp_dims = {"w13": 0, "w2": 1}

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        rows = x.index_select(0, tokens)
        if self._grouped_mm_fits(x):
            ends = torch.bincount(flat_ids, minlength=self.num_experts).cumsum(0).to(torch.int32)
            out = self._grouped(rows, ends)
        else:
            out = self._per_expert(rows, flat_ids.index_select(0, order))
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _grouped_mm_fits(self, x: torch.Tensor) -> bool:
        per = _ALIGN_BYTES // x.element_size()
        return x.shape[1] % per == 0 and self.intermediate_size % per == 0

    def _grouped(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        gate, up = F.grouped_mm(rows, self.w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=ends)

    def _per_expert(self, rows: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Sizes F.grouped_mm cannot take: one matmul per expert (reads the counts back)."""
        out = torch.empty(rows.shape[0], self.w2.shape[1], dtype=rows.dtype, device=rows.device)
        counts = torch.bincount(expert_of_row, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                part = rows[start : start + count]
                gate, up = F.linear(part, self.w13[expert]).chunk(2, dim=-1)
                out[start : start + count] = F.linear(F.silu(gate) * up, self.w2[expert])
                start += count
        return out
