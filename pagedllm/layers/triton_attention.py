"""Paged attention in Triton, for GPUs: K/V are written by slot and read straight from the blocks.

The pool of a layer is `[num_blocks, block_size, num_kv_heads, head_dim]`; token slot `s` is
block `s // block_size`, offset `s % block_size`. Three kernels, each one launch per layer:

- `write_kv`: a step's new K/V rows into their slots (slot < 0: a padding row, skipped — the
  rows a CUDA graph's batch is padded with);
- `decode`: one program per (decode row, KV head) attends the row's query heads of that KV group
  together (GQA: one read of each K/V tile serves the whole group) over the row's context,
  found through its block table, with an online softmax; a row whose context is empty writes
  zeros (padding rows);
- `prefill`: one program per (query tile, chunk, query head) attends a prefill chunk's queries to
  its cached prefix and to the chunk itself (written to the pool first), causally aligned to the
  bottom right; sliding windows in both.

Nothing is gathered or materialised: a context is read once per KV head (decode) or once per
query tile (prefill). The tensor-core products run in the KV dtype; float32 uses IEEE products
(not TF32), so the float32 parity with transformers holds on GPUs as on CPUs.

Triton runs these on CPU tensors too under its interpreter (`TRITON_INTERPRET=1`), which is how
`make test` checks them against the PyTorch reference on machines without a GPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with PyTorch's CUDA wheels; the CPU wheel lacks it
    triton = None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device` (None: it can)."""
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "Triton kernels need a CUDA device (TRITON_INTERPRET=1 runs them on the CPU, slowly, for testing)"


@dataclass
class TritonAttentionMetadata:
    """A step's layout for the Triton kernels: decode rows first, then prefill chunks."""

    num_decodes: int  # rows [0, num_decodes) are decodes (a CUDA graph's padding rows included)
    decode_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] block ids
    decode_ctx_lens: torch.Tensor | None = None  # [num_decodes]; 0 for a padding row
    num_prefills: int = 0
    max_prefill_len: int = 0  # the longest chunk's query count (the grid's first dimension)
    prefill_q_starts: torch.Tensor | None = None  # [num_prefills] first row of each chunk
    prefill_q_lens: torch.Tensor | None = None  # [num_prefills]
    prefill_ctx_lens: torch.Tensor | None = None  # [num_prefills] cached prefix + chunk
    prefill_tables: torch.Tensor | None = None  # [num_prefills, max_blocks]


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


if triton is not None:

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cs, stride_ch, NUM_KV_HEADS, HEAD_DIM,
                         H_PAD: tl.constexpr, D_PAD: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slots + token)
        heads = tl.arange(0, H_PAD)[:, None]
        dims = tl.arange(0, D_PAD)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (heads * 0 + slot >= 0)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        target = slot * stride_cs + heads * stride_ch + dims
        tl.store(k_cache + target, k, mask=mask)
        tl.store(v_cache + target, v, mask=mask)

    @triton.jit
    def _attend_tile(q, k_cache, v_cache, kv_offsets, kv_mask, visible, scale, m_i, l_i, acc, IEEE: tl.constexpr):
        """One tile of keys/values folded into the running (max, sum, output) of an online softmax;
        `visible` masks the scores ([queries, keys]). Shared by the decode and prefill kernels."""
        k = tl.load(k_cache + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(visible, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_kernel(q_ptr, k_cache, v_cache, out_ptr, tables, ctx_lens, scale,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_table, stride_cs, stride_ch,
                       GROUP, HEAD_DIM, BLOCK_SIZE, WINDOW: tl.constexpr,
                       G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx = tl.load(ctx_lens + row).to(tl.int32)
        groups = tl.arange(0, G_PAD)
        dims = tl.arange(0, D_PAD)
        heads = kv_head * GROUP + groups
        q_mask = (groups[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
        low = tl.maximum(ctx - WINDOW, 0) if WINDOW > 0 else 0
        m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        offsets = tl.arange(0, BLOCK_N)
        for start in range((low // BLOCK_N) * BLOCK_N, ctx, BLOCK_N):
            pos = start + offsets
            valid = (pos < ctx) & (pos >= low)
            block = tl.load(tables + row * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offsets = slot[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
            kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
            m_i, l_i, acc = _attend_tile(q, k_cache, v_cache, kv_offsets, kv_mask, valid[None, :], scale,
                                         m_i, l_i, acc, IEEE)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, tables, q_starts, q_lens, ctx_lens, scale,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_table, stride_cs, stride_ch,
                        GROUP, HEAD_DIM, BLOCK_SIZE, WINDOW: tl.constexpr,
                        D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        chunk = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // GROUP
        q_len = tl.load(q_lens + chunk).to(tl.int32)
        q_start = tl.load(q_starts + chunk).to(tl.int32)
        ctx = tl.load(ctx_lens + chunk).to(tl.int32)
        first_pos = ctx - q_len  # position of the chunk's first query
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = first_pos + rows
        dims = tl.arange(0, D_PAD)
        q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0.0)
        # keys up to the tile's last query (none when the tile is past the chunk's end)
        high = tl.minimum(ctx, first_pos + tile * BLOCK_M + BLOCK_M)
        high = high * (tile * BLOCK_M < q_len).to(tl.int32)
        low = tl.maximum(first_pos + tile * BLOCK_M - WINDOW + 1, 0) if WINDOW > 0 else 0
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        offsets = tl.arange(0, BLOCK_N)
        for start in range((low // BLOCK_N) * BLOCK_N, high, BLOCK_N):
            pos = start + offsets
            in_ctx = pos < high
            block = tl.load(tables + chunk * stride_table + pos // BLOCK_SIZE, mask=in_ctx, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offsets = slot[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
            kv_mask = in_ctx[:, None] & (dims[None, :] < HEAD_DIM)
            visible = in_ctx[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (q_pos[:, None] - pos[None, :] < WINDOW)
            m_i, l_i, acc = _attend_tile(q, k_cache, v_cache, kv_offsets, kv_mask, visible, scale, m_i, l_i, acc, IEEE)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (any row and head strides, unit stride along D); slots: [T], < 0 skipped."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _check_last_dim(k, v, k_cache, v_cache)
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), kv_heads, head_dim,
        H_PAD=triton.next_power_of_2(kv_heads), D_PAD=triton.next_power_of_2(head_dim),
    )


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
           window: int, scale: float, out: torch.Tensor) -> None:
    """q, out: [rows, H, D]; each row attends to the first ctx_lens[row] positions of its table."""
    rows, num_heads, head_dim = q.shape
    if rows == 0:
        return
    _check_last_dim(q, out, k_cache, v_cache)
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    _decode_kernel[(rows, kv_heads)](
        q, k_cache, v_cache, out, tables, ctx_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), k_cache.stride(1), k_cache.stride(2),
        group, head_dim, k_cache.shape[1], window,
        G_PAD=_pow2(group), D_PAD=_pow2(head_dim), BLOCK_N=64 if head_dim <= 128 else 32,
        IEEE=q.dtype == torch.float32,
    )


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonAttentionMetadata, window: int,
            scale: float, out: torch.Tensor) -> None:
    """q, out: [T, H, D] of the whole batch; writes the rows of every prefill chunk in `meta`."""
    if meta.num_prefills == 0:
        return
    _check_last_dim(q, out, k_cache, v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    block_m = 64 if head_dim <= 64 else 32
    grid = (triton.cdiv(meta.max_prefill_len, block_m), meta.num_prefills, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.prefill_tables, meta.prefill_q_starts, meta.prefill_q_lens, meta.prefill_ctx_lens,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.prefill_tables.stride(0),
        k_cache.stride(1), k_cache.stride(2), num_heads // kv_heads, head_dim, k_cache.shape[1], window,
        D_PAD=_pow2(head_dim), BLOCK_M=block_m, BLOCK_N=32, IEEE=q.dtype == torch.float32,
    )


def _check_last_dim(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the Triton attention kernels need unit stride along head_dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the Triton attention kernels need contiguous KV pools")
