"""The token embedding split by vocabulary rows across a tensor-parallel group.

Each rank holds ceil(V / size) consecutive rows (the last rank's tail zero-padded); a token's
vector comes from the one rank that holds its row and the others contribute zeros, so one
all-reduce assembles the batch. The tied LM head shares these rows: each rank scores its part of
the vocabulary and rank 0 gathers the columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.group import ParallelGroup


class VocabParallelEmbedding(nn.Embedding):
    tp_dims = {"weight": 0}  # checkpoint dims split across ranks (see models/loader.py)

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup):
        super().__init__(-(-vocab_size // group.size), hidden_size)
        self.group = group
        self.first_row = group.rank * self.num_embeddings

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.first_row
        held = (local >= 0) & (local < self.num_embeddings)
        vectors = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(vectors)
