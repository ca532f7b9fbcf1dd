"""Decode steps replayed as CUDA graphs.

A decode step of a small model on a GPU is mostly kernel launches: each of a few hundred ops costs
the CPU tens of microseconds to launch while the GPU finishes it in a few. A CUDA graph records a
step's launches once and replays them with one call. Graphs have fixed shapes and fixed addresses,
so at start-up the model's forward pass (embedding to final norm) is captured once per batch size
of a ladder — 1, 2, 4, 8, then every multiple of 8 up to `max_num_seqs`, as vLLM does — over
static input buffers (token ids, positions, slot mapping, block tables, context lengths). A step
whose rows are all decodes is padded to the next captured size: padding rows have slot -1 (the
KV write skips them) and an empty context (attention writes zeros), and their outputs are never
read. The LM head and the sampler run eagerly on the rows that sample, as do prefill and mixed
steps (their shapes vary too much to capture).
"""
from __future__ import annotations

import bisect

import torch

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.triton_attention import TritonAttentionMetadata

_STATIC = ("input_ids", "positions", "slot_mapping", "decode0.ctx_lens")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8, and max_num_seqs itself."""
    sizes = {size for size in (1, 2, 4) if size < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return sorted(sizes)


def padded_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `rows` rows (None: more than the largest)."""
    index = bisect.bisect_left(sizes, rows)
    return sizes[index] if index < len(sizes) else None


class DecodeGraphs:
    """The captured forward passes and the static buffers they read. One owner: the model
    runner, which copies a step's staged arrays in (`replay`) and reads the hidden states out."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_blocks: int, device: torch.device):
        self.model = model
        self.sizes = sizes
        largest = sizes[-1]
        self.buffers = {name: torch.zeros(largest, dtype=torch.int64, device=device) for name in _STATIC}
        self.buffers["slot_mapping"].fill_(-1)
        self.tables = torch.zeros(largest, max_blocks, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def metadata(self, size: int) -> AttentionMetadata:
        layout = TritonAttentionMetadata(num_decodes=size, decode_tables=self.tables[:size],
                                         decode_ctx_lens=self.buffers["decode0.ctx_lens"][:size])
        return AttentionMetadata(self.buffers["slot_mapping"][:size], [], [], triton=layout)

    def capture(self) -> None:
        """Largest first, all in one memory pool (a smaller graph reuses the larger's memory).
        Each size runs once eagerly first, so Triton compiles and cuBLAS sets up outside capture.
        The padding buffers (slot -1, empty contexts) make these runs write nothing to the pool."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ids, positions = self.buffers["input_ids"][:size], self.buffers["positions"][:size]
            meta = self.metadata(size)
            self.model(ids, positions, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, meta)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()

    def replay(self, views: dict[str, torch.Tensor], size: int) -> torch.Tensor:
        """Copies the step's arrays (already padded to `size` rows) into the static buffers and
        replays; the hidden states of all `size` rows (valid until the next replay). A size not
        captured (a CPU runner under test) runs the same forward pass on the buffers eagerly."""
        for name in _STATIC:
            self.buffers[name][:size].copy_(views[name])
        tables = views["decode0.tables"]
        self.tables[:size, : tables.shape[1]].copy_(tables)
        self.num_replays += 1
        if size not in self.graphs:
            return self.model(self.buffers["input_ids"][:size], self.buffers["positions"][:size], self.metadata(size))
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden
