"""Decode attention over the paged KV pool as one fused loop nest, written in PyTorch and
compiled by PyTorch's own compiler (torch.compile / inductor generates the C++).

The eager path gathers each sequence's blocks into a padded copy and then runs SDPA over it:
three passes over the KV bytes, and SDPA's CPU kernel runs single-query decode far below the
memory system's speed. Written as gather → dot products → softmax → weighted sum, inductor fuses
the gather into the reductions and reads each K/V block once: measured 4x faster per layer at
64 sequences x 256 tokens on this machine, within 1e-6 of SDPA.

Compilation happens once per model shape at engine start (~15 s on a cold machine, a few
seconds with inductor's on-disk cache warm). Only the batch, block-count and pool-size
dimensions are dynamic: head counts, head_dim and block_size stay static, which lets inductor
vectorise for them and keeps "duck sizing" from tying, say, the batch size to head_dim because
they happened to be equal when traced (every later batch size would then recompile). A batch of
1 or a single block column is padded to 2 so the 0/1 specialisations never need their own
graphs. If compilation fails (no C++ compiler, an inductor bug), the engine falls back to SDPA.
"""
from __future__ import annotations

import logging
import shutil

import torch

logger = logging.getLogger("pagedllm.attention")

_compiled = None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q: [B, Hkv, G, D] (query head h = kv head h // G, as transformers' repeat_kv groups them);
    caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, nb]; ctx_lens: [B].
    `window` <= 0 means no sliding window. Returns [B, Hkv, G, D]."""
    batch, num_blocks = block_tables.shape
    k = k_cache[block_tables]  # [B, nb, bs, Hkv, D] — fused into the reductions, never stored
    v = v_cache[block_tables]
    scores = (q[:, None, None] * k[:, :, :, :, None, :]).sum(-1) * scale  # [B, nb, bs, Hkv, G]
    scores = scores.reshape(batch, -1, scores.shape[-2], scores.shape[-1])  # [B, L, Hkv, G]
    positions = torch.arange(scores.shape[1], device=q.device)
    last = (ctx_lens - 1)[:, None]
    visible = positions[None, :] <= last
    if window > 0:
        visible = visible & (last - positions[None, :] < window)
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1).reshape(batch, num_blocks, -1, scores.shape[-2], scores.shape[-1])
    return (probs[..., None] * v[:, :, :, :, None, :]).sum((1, 2))


def compiler_available() -> bool:
    return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))


def compiled_paged_decode():
    """The compiled function, built once per process (inductor caches per shape signature)."""
    global _compiled
    if _compiled is None:
        # Several engines (models of different shapes) in one process each need a graph.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled = torch.compile(paged_decode, dynamic=None)
    return _compiled


def run_compiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """`paged_decode`, compiled, with only the batch / block-count / pool-size dims dynamic."""
    batch = q.shape[0]
    if block_tables.shape[1] == 1:
        block_tables = torch.cat((block_tables, block_tables), dim=1)  # masked: beyond every context
    if batch == 1:
        q, block_tables, ctx_lens = torch.cat((q, q)), torch.cat((block_tables, block_tables)), torch.cat((ctx_lens, ctx_lens))
    for tensor, dims in ((q, (0,)), (block_tables, (0, 1)), (ctx_lens, (0,)), (k_cache, (0,)), (v_cache, (0,))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return compiled_paged_decode()(q, k_cache, v_cache, block_tables, ctx_lens, window, scale)[:batch]


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, windows: list[int | None]) -> bool:
    """Compile now (at engine start) rather than on the first request; False if it failed."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = num_heads // num_kv_heads
    try:
        for window in windows:
            # 3 sequences x 2 blocks: no dynamic size equal to another when traced.
            q = torch.zeros(3, num_kv_heads, group, head_dim, dtype=k_cache.dtype, device=k_cache.device)
            tables = torch.zeros(3, 2, dtype=torch.long, device=k_cache.device)
            lens = torch.tensor([1, block_size + 1, 2], device=k_cache.device)
            run_compiled(q, k_cache, v_cache, tables, lens, window or 0, head_dim**-0.5)
        return True
    except Exception as exc:  # noqa: BLE001 — any compiler failure means: use the eager path
        logger.warning("compiled paged attention unavailable (%s: %s); using SDPA", type(exc).__name__, exc)
        return False
