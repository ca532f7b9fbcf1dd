"""Paged attention: C kernels on CPU, Triton kernels on GPU (layers/triton_attention.py), SDPA
as the reference everywhere.

The KV pool of a layer is `[num_blocks, block_size, num_kv_heads, head_dim]` (the paged layout).
A step's batch puts its decode tokens first, then its prefill chunks:

- decodes: by default (fp32 on a CPU with a C compiler) one C kernel attends them all, reading
  each context's blocks straight from the pool (layers/paged_decode.py). Otherwise they are
  sorted by context length and cut into a few buckets so that short contexts are not padded to
  the longest; each bucket's blocks are gathered with one `index_select` over whole blocks
  (several times faster on CPU than advanced indexing), positions past each context are
  masked, and SDPA attends;
- prefill chunks: by default one C kernel per chunk (layers/csrc/prefill_attention.c) reads the
  chunk's context — cached prefix and the K/V just written — straight from the pool. Otherwise
  a chunk with no cached prefix attends causally to its own fresh K/V, never touching the pool
  (SDPA's causal fast path), and a chunk that follows a cached prefix (prefix-cache hit, later
  chunk of a chunked prefill, recompute) gathers its context from the pool and uses a
  bottom-right causal mask.

GQA is handled by SDPA's `enable_gqa`, so K/V are never repeated per query head.

With the Triton backend (the default on CUDA) none of the above is gathered: one launch writes
the step's K/V by slot, one attends every decode row and one every prefill chunk, each reading
the pool through the block tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import triton_attention
from pagedllm.layers.paged_decode import run_kernel, run_prefill_kernel


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: queries [q_start, q_start+q_len) of the batch, whose
    context (cached prefix + the chunk itself) is ctx_len tokens long."""

    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor | None = None  # blocks holding the context (C kernel, or SDPA after a prefix)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)


@dataclass
class DecodeBucket:
    """Decode tokens [start, start + count) of the batch, with similar context lengths."""

    start: int
    count: int
    block_tables: torch.Tensor  # [count, max_blocks], padded with block 0 past each context
    ctx_lens: torch.Tensor  # [count]
    masks: dict[int | None, torch.Tensor]  # SDPA path only: window -> additive mask [count, 1, 1, L]


@dataclass
class AttentionMetadata:
    """Everything a forward pass needs about the batch layout; built once per step."""

    # [T] flat slot (block * block_size + offset) of each token; None: nothing is written to the
    # pool (an embedding's forward, worker/pooler.py: causal chunks that only attend to themselves)
    slot_mapping: torch.Tensor | None
    decodes: list[DecodeBucket]
    prefills: list[PrefillChunk]
    kernel_attention: bool = False  # the C kernels (layers/paged_decode.py) or SDPA
    triton: triton_attention.TritonAttentionMetadata | None = None  # the GPU kernels: they replace the two lists


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility: key j is visible from query i when j <= i and
    i - j < window, as transformers' masks define it."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the batch's new tokens. Returns [T, H, D]."""
        if meta.triton is not None:
            return self._triton(q, k, v, meta)
        if meta.slot_mapping is not None:
            kv_shape = (-1, self.num_kv_heads, self.head_dim)
            # a pool of another dtype (kv_cache_dtype) takes the new K/V rounded as torch rounds
            self.k_cache.view(kv_shape).index_copy_(0, meta.slot_mapping, k.to(self.k_cache.dtype))
            self.v_cache.view(kv_shape).index_copy_(0, meta.slot_mapping, v.to(self.v_cache.dtype))
        out = torch.empty_like(q)
        for bucket in meta.decodes:
            end = bucket.start + bucket.count
            if meta.kernel_attention:
                self._kernel_decode(q[bucket.start : end], bucket, out[bucket.start : end])
            else:
                out[bucket.start : end] = self._decode(q[bucket.start : end], bucket)
        for chunk in meta.prefills:
            end = chunk.q_start + chunk.q_len
            if meta.kernel_attention:
                self._kernel_prefill(q[chunk.q_start : end], chunk, out[chunk.q_start : end])
            else:
                out[chunk.q_start : end] = self._prefill(q[chunk.q_start : end], k[chunk.q_start : end], v[chunk.q_start : end], chunk)
        return out

    def _triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Writes the new K/V by slot, then decodes and prefill chunks read the pool: one launch each."""
        layout, window, scale = meta.triton, self.sliding_window or 0, self.head_dim**-0.5
        triton_attention.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if layout.num_decodes:
            rows = slice(0, layout.num_decodes)
            triton_attention.decode(q[rows], self.k_cache, self.v_cache, layout.decode_tables, layout.decode_ctx_lens,
                                    window, scale, out[rows])
        triton_attention.prefill(q, self.k_cache, self.v_cache, layout, window, scale, out)
        return out

    def _kernel_decode(self, q: torch.Tensor, bucket: DecodeBucket, out: torch.Tensor) -> None:
        """Reads q where the fused projection left it and writes into out: no copies."""
        grouped = (q.shape[0], self.num_kv_heads, -1, self.head_dim)
        run_kernel(
            q.view(grouped), self.k_cache, self.v_cache, bucket.block_tables, bucket.ctx_lens,
            self.sliding_window or 0, self.head_dim**-0.5, out=out.view(grouped),
        )

    def _kernel_prefill(self, q: torch.Tensor, chunk: PrefillChunk, out: torch.Tensor) -> None:
        grouped = (q.shape[0], self.num_kv_heads, -1, self.head_dim)
        run_prefill_kernel(
            q.view(grouped), self.k_cache, self.v_cache, chunk.block_ids, chunk.ctx_len, self.sliding_window or 0,
            self.head_dim**-0.5, out.view(grouped),
        )

    def _decode(self, q: torch.Tensor, bucket: DecodeBucket) -> torch.Tensor:
        batch, max_blocks = bucket.block_tables.shape
        length = max_blocks * self.k_cache.shape[1]
        block_ids = bucket.block_tables.view(-1)
        k = torch.index_select(self.k_cache, 0, block_ids).view(batch, length, self.num_kv_heads, self.head_dim)
        v = torch.index_select(self.v_cache, 0, block_ids).view(batch, length, self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=bucket.masks[self.sliding_window],
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.block_ids is not None:
            k = torch.index_select(self.k_cache, 0, chunk.block_ids).view(-1, self.num_kv_heads, self.head_dim)[: chunk.ctx_len]
            v = torch.index_select(self.v_cache, 0, chunk.block_ids).view(-1, self.num_kv_heads, self.head_dim)[: chunk.ctx_len]
        mask = chunk.masks.get(self.sliding_window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)
