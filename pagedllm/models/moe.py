"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its gated shared expert) and Qwen3-MoE.

They attend exactly as their dense relatives (Mistral, Qwen2, Qwen3 — models/llama.py); only
the feed-forward differs: a router picks the top-k experts per token (layers/moe.py computes
them grouped by expert), and some Qwen layers (`mlp_only_layers`, `decoder_sparse_step`) keep a
dense MLP. Checkpoints store each expert's projections separately (`experts.E.w1/w3/w2` for
Mixtral, `experts.E.gate_proj/up_proj/down_proj` for Qwen, under `block_sparse_moe` or `mlp`);
they are loaded into the stacked expert weights here.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.linear import Linear
from pagedllm.layers.moe import FusedMoE
from pagedllm.models.llama import MLP, CausalLM

_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_GATE, _DOWN = ("w1", "gate_proj"), ("w2", "down_proj")


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.gate.quantizable = False  # int8 would move tokens between experts near a tie
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.expert_intermediate_size, moe.renormalize)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoECausalLM(CausalLM):
    def make_mlp(self, layer_index: int) -> nn.Module:
        if self.config.moe.sparse_layers[layer_index]:
            return SparseMoeBlock(self.config)
        return MLP(self.config)

    def checkpoint_target(self, key: str) -> tuple[str, int, Callable[[torch.Tensor], torch.Tensor]]:
        """Expert e's gate and up fill shards 2e and 2e + 1 of the stacked `w13`, its down shard e
        of `w2`; Mixtral's `block_sparse_moe` is our `mlp`."""
        key = key.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT.search(key)
        if match is None:
            return super().checkpoint_target(key)
        expert, proj, prefix = int(match[1]), match[2], key[: match.start()] + ".experts."
        if proj in _DOWN:
            return prefix + "w2", expert, lambda p: p[expert]
        size, half = self.config.moe.expert_intermediate_size, 0 if proj in _GATE else 1
        return prefix + "w13", 2 * expert + half, lambda p: p[expert].narrow(0, half * size, size)

    def expected_shards(self, name: str) -> set[int]:
        experts = self.config.moe.num_experts
        if name.endswith(".experts.w13"):
            return set(range(2 * experts))
        if name.endswith(".experts.w2"):
            return set(range(experts))
        return super().expected_shards(name)
