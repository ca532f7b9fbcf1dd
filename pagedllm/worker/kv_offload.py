"""Layer-wise KV offload: the KV pool lives in host memory and the device holds two layers.

With `kv_offload=True` the pool (every layer's blocks) is a host arena — pinned memory when the
device is a GPU — and the device keeps a working buffer of `buffer_blocks` blocks for each of two
layers. Each step, the blocks its sequences use are numbered 0..B-1 and the step's block tables
are rewritten to those numbers, so attention reads a compact pool of B blocks and every
attention path (C decode kernel, SDPA decode, prefill over a cached prefix) runs unchanged.
Before layer i runs, its B blocks are copied into buffer i % 2 and the layer's attention is
bound to it; after it ran, the blocks the step wrote (its new tokens' slots) go back to the host.
On a GPU the copy of layer i + 1 runs on a side stream while layer i computes (double
buffering); on a CPU the copies are plain and the point is the budget: the device side needs
two layers' worth of a step's blocks, not the whole pool, so contexts far larger than the
device KV budget run. The scheduler bounds a step's blocks by the buffer (`max_step_blocks`).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from pagedllm.layers.attention import PagedAttention
from pagedllm.worker.input_batch import BatchChunk
from pagedllm.worker.kv_cache import KVCache

_BUFFERS = 2


class LayerwiseKVOffload:
    def __init__(self, pool: KVCache, layers: list[PagedAttention], buffer_blocks: int, device: torch.device):
        self.pool, self.layers, self.device = pool, layers, device
        shape = (_BUFFERS, buffer_blocks, *pool.k.shape[2:])
        self.k_buffers = torch.zeros(shape, dtype=pool.k.dtype, device=device)
        self.v_buffers = torch.zeros(shape, dtype=pool.k.dtype, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.loaded = [None] * _BUFFERS  # per buffer: the event after which its load finished
        self.step_blocks = torch.empty(0, dtype=torch.long)  # host pool ids of the step's blocks
        self.written = torch.empty(0, dtype=torch.long)  # their compact numbers that the step writes

    def buffer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[index], self.v_buffers[index]

    @property
    def buffer_blocks(self) -> int:
        return self.k_buffers.shape[1]

    def plan(self, chunks: list[BatchChunk]) -> list[BatchChunk]:
        """Number the step's blocks 0..B-1 and rewrite its block tables to those numbers."""
        blocks = sorted({block for chunk in chunks for block in chunk.block_table})
        assert len(blocks) <= self.buffer_blocks, "the scheduler bounds a step's blocks by the buffer"
        number = {block: i for i, block in enumerate(blocks)}
        size = self.pool.k.shape[2]
        written = sorted({number[chunk.block_table[p // size]] for chunk in chunks for p in range(chunk.start, chunk.end)})
        self.step_blocks = torch.tensor(blocks, dtype=torch.long)
        self.written = torch.tensor(written, dtype=torch.long)
        return [replace(chunk, block_table=[number[b] for b in chunk.block_table]) for chunk in chunks]

    def before_layer(self, index: int) -> None:
        """Bind layer `index` to its loaded buffer (loading it now if nothing prefetched it), and
        start loading the next layer into the other buffer."""
        buffer = index % _BUFFERS
        if index == 0:
            self._load(0, 0)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[buffer])
        count = len(self.step_blocks)
        self.layers[index].bind_cache(self.k_buffers[buffer, :count], self.v_buffers[buffer, :count])
        if index + 1 < len(self.layers) and self.stream is not None:
            self._load(index + 1, (index + 1) % _BUFFERS)

    def after_layer(self, index: int) -> None:
        """The blocks layer `index` wrote go back to the host pool; on CPU, the next layer is
        loaded now (there is no second engine to overlap it with)."""
        buffer = index % _BUFFERS
        rows = self.step_blocks.index_select(0, self.written)
        k = self.k_buffers[buffer].index_select(0, self.written.to(self.device))
        v = self.v_buffers[buffer].index_select(0, self.written.to(self.device))
        self.pool.k[index].index_copy_(0, rows, k.to(self.pool.k.device))
        self.pool.v[index].index_copy_(0, rows, v.to(self.pool.k.device))
        if index + 1 < len(self.layers) and self.stream is None:
            self._load(index + 1, (index + 1) % _BUFFERS)

    def _load(self, layer: int, buffer: int) -> None:
        count = len(self.step_blocks)
        k = self.pool.k[layer].index_select(0, self.step_blocks)
        v = self.pool.v[layer].index_select(0, self.step_blocks)
        if self.stream is None:
            self.k_buffers[buffer, :count] = k
            self.v_buffers[buffer, :count] = v
            return
        # The other buffer is free once the compute stream is past the layer that used it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.k_buffers[buffer, :count].copy_(k.pin_memory(), non_blocking=True)
            self.v_buffers[buffer, :count].copy_(v.pin_memory(), non_blocking=True)
            self.loaded[buffer] = torch.cuda.Event()
            self.loaded[buffer].record(self.stream)
