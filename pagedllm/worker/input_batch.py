"""The flat batch of one step: input ids, positions, slot mapping and attention metadata.

Decodes come first, longest context first (so they can be cut into buckets of similar lengths),
then prefill chunks. Everything is computed on the host and staged (worker/staging.py); the
attention metadata is then assembled from device views, and masks are computed on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.layers.attention import AttentionMetadata, DecodeBucket, PrefillChunk, additive_mask, allowed_keys
from pagedllm.layers.triton_attention import TritonAttentionMetadata
from pagedllm.step.scheduler_output import PromptLogprobsRequest
from pagedllm.worker.staging import Staging

# How decodes are cut into SDPA calls: at most 4, a new one where padding would double the KV
# gathered. The C kernel reads only each context's own blocks, so it takes all decodes at once.
SDPA_DECODE_BUCKETS = (4, 2)
KERNEL_DECODE_BUCKETS = (1, 0)


@dataclass(slots=True)
class BatchChunk:
    """Positions [start, start + len(token_ids)) of one sequence, laid out in this step's batch."""

    seq_id: int
    start: int
    token_ids: list[int]
    block_table: list[int]  # the sequence's blocks; covers every position up to the chunk's end
    prompt_logprobs: PromptLogprobsRequest | None = None
    # Rows past the first laid out as decode rows, each attending to the context up to its own
    # position: a decode's proposals to verify (token_ids = [last token, *proposals]), or, where
    # a step runs a short chunk as one fused step, the chunk's other tokens.
    num_spec: int = 0

    @property
    def is_decode(self) -> bool:
        """One new position per row of context (a plain decode, or a decode with proposals)."""
        return self.num_tokens == 1 + self.num_spec

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class _Bucket:
    start: int  # first row
    count: int
    max_blocks: int


@dataclass
class BatchLayout:
    """Where each chunk's rows landed, and what was staged for attention (host side)."""

    order: list[int]  # chunk indices in batch order
    first_rows: dict[int, int]  # chunk index -> its first row
    last_rows: dict[int, int]  # chunk index -> its last row
    buckets: list[_Bucket]
    prefills: list[tuple[int, BatchChunk]]  # (first row, chunk)


def batch_order(chunks: list[BatchChunk]) -> list[int]:
    return sorted(range(len(chunks)), key=lambda i: (not chunks[i].is_decode, -chunks[i].start))


def stage_batch(chunks: list[BatchChunk], block_size: int, kernel_attention: bool, staging: Staging, prefix: str = "",
                num_steps: int = 1, triton: bool = False, pad_rows: int = 0) -> BatchLayout:
    """Lay out the chunks and stage their arrays under `prefix`. A decode that verifies k
    proposals contributes k + 1 decode rows, each attending to the context up to its position.
    For `num_steps` greedy steps (multi-step scheduling) a decode's staged block table also
    covers the positions of the steps after the first. With `triton` (the GPU kernels) all
    decodes form one bucket and the prefill chunks' tables are staged as one padded array;
    `pad_rows` padding decode rows (slot -1, empty context) follow the decodes, which is how a
    CUDA graph's fixed batch is filled (only for steps without prefill chunks)."""
    order = batch_order(chunks)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decodes: list[tuple[int, list[int]]] = []  # (context length, block table) per decode row
    layout = BatchLayout(order, {}, {}, [], [])
    for index in order:
        chunk = chunks[index]
        layout.first_rows[index] = len(ids)
        ids.extend(chunk.token_ids)
        if chunk.is_decode:
            for p in range(chunk.start, chunk.end):
                positions.append(p)
                slots.append(chunk.block_table[p // block_size] * block_size + p % block_size)
                decodes.append((p + 1, chunk.block_table))
        else:
            pos = np.arange(chunk.start, chunk.end)
            positions.extend(pos.tolist())
            slots.extend((np.asarray(chunk.block_table)[pos // block_size] * block_size + pos % block_size).tolist())
            layout.prefills.append((layout.first_rows[index], chunk))
        layout.last_rows[index] = len(ids) - 1
    if pad_rows:
        assert not layout.prefills, "only an all-decode step is padded"
        ids.extend([0] * pad_rows)
        positions.extend([0] * pad_rows)
        slots.extend([-1] * pad_rows)
        decodes.extend([(0, [])] * pad_rows)
    staging.add(prefix + "input_ids", ids)
    staging.add(prefix + "positions", positions)
    staging.add(prefix + "slot_mapping", slots)
    layout.buckets = _stage_decode_buckets(decodes, block_size, kernel_attention or triton, staging, prefix, num_steps - 1)
    if triton:
        _stage_triton_prefills(layout, block_size, staging, prefix)
        return layout
    for number, (_, chunk) in enumerate(layout.prefills):
        if chunk.start > 0 or kernel_attention:  # the C kernel reads even a fresh chunk's K/V from the pool
            staging.add(f"{prefix}prefill{number}.blocks", chunk.block_table[: -(-chunk.end // block_size)])
    return layout


def _stage_triton_prefills(layout: BatchLayout, block_size: int, staging: Staging, prefix: str) -> None:
    """Every prefill chunk's first row, query count, context length and block table (padded to
    the widest), for one launch of the prefill kernel."""
    if not layout.prefills:
        return
    widths = [-(-chunk.end // block_size) for _, chunk in layout.prefills]
    width = max(widths)
    tables = [list(chunk.block_table[:n]) + [0] * (width - n) for (_, chunk), n in zip(layout.prefills, widths)]
    staging.add(prefix + "prefills.q_starts", [row for row, _ in layout.prefills])
    staging.add(prefix + "prefills.q_lens", [chunk.num_tokens for _, chunk in layout.prefills])
    staging.add(prefix + "prefills.ctx_lens", [chunk.end for _, chunk in layout.prefills])
    staging.add(prefix + "prefills.tables", tables, shape=(len(tables), width))


def _stage_decode_buckets(decodes: list[tuple[int, list[int]]], block_size: int, kernel_attention: bool, staging: Staging,
                          prefix: str, reach: int = 0) -> list[_Bucket]:
    """Cut decode rows (sorted about longest first) where padding to the bucket's first context
    would multiply its KV by more than the backend's factor, into at most its number of calls.
    Tables cover `reach` positions past each context."""
    max_buckets, factor = KERNEL_DECODE_BUCKETS if kernel_attention else SDPA_DECODE_BUCKETS
    num_blocks = [-(-(ctx + reach) // block_size) for ctx, _ in decodes]
    buckets: list[_Bucket] = []
    start = 0
    while start < len(decodes):
        end = start + 1
        last_bucket = len(buckets) == max_buckets - 1
        while end < len(decodes) and (last_bucket or factor * num_blocks[end] > num_blocks[start]):
            end += 1
        width = max(num_blocks[start:end])
        tables = [table[:n] + [0] * (width - len(table[:n])) for (_, table), n in zip(decodes[start:end], num_blocks[start:end])]
        number = len(buckets)
        staging.add(f"{prefix}decode{number}.tables", tables, shape=(end - start, width))
        staging.add(f"{prefix}decode{number}.ctx_lens", [ctx for ctx, _ in decodes[start:end]])
        buckets.append(_Bucket(start, end - start, width))
        start = end
    return buckets


def attention_metadata(layout: BatchLayout, views: dict[str, torch.Tensor], kernel_attention: bool, block_size: int,
                       windows: list[int | None], dtype: torch.dtype, prefix: str = "", triton: bool = False) -> AttentionMetadata:
    if triton:
        return AttentionMetadata(views[prefix + "slot_mapping"], [], [], triton=triton_metadata(layout, views, prefix))
    device = views[prefix + "slot_mapping"].device
    decodes = []
    for number, bucket in enumerate(layout.buckets):
        ctx_lens = views[f"{prefix}decode{number}.ctx_lens"]
        masks = {}
        if not kernel_attention:
            k_pos = torch.arange(bucket.max_blocks * block_size, device=device)
            for window in windows:
                masks[window] = additive_mask(allowed_keys(ctx_lens - 1, k_pos, window), dtype)[:, None, None, :]
        decodes.append(DecodeBucket(bucket.start, bucket.count, views[f"{prefix}decode{number}.tables"], ctx_lens, masks))
    prefills = []
    for number, (first_row, chunk) in enumerate(layout.prefills):
        prefill = PrefillChunk(q_start=first_row, q_len=chunk.num_tokens, ctx_len=chunk.end)
        if chunk.start > 0 or kernel_attention:
            prefill.block_ids = views[f"{prefix}prefill{number}.blocks"]
        for window in () if kernel_attention else windows:
            if chunk.start > 0 or window is not None:
                q_pos = torch.arange(chunk.start, chunk.end, device=device)
                allowed = allowed_keys(q_pos, torch.arange(chunk.end, device=device), window)
                prefill.masks[window] = additive_mask(allowed, dtype)
        prefills.append(prefill)
    return AttentionMetadata(views[prefix + "slot_mapping"], decodes, prefills, kernel_attention)


def triton_metadata(layout: BatchLayout, views: dict[str, torch.Tensor], prefix: str = "") -> TritonAttentionMetadata:
    meta = TritonAttentionMetadata(num_decodes=sum(bucket.count for bucket in layout.buckets))
    if layout.buckets:
        meta.decode_tables, meta.decode_ctx_lens = views[f"{prefix}decode0.tables"], views[f"{prefix}decode0.ctx_lens"]
    if layout.prefills:
        meta.num_prefills = len(layout.prefills)
        meta.max_prefill_len = max(chunk.num_tokens for _, chunk in layout.prefills)
        meta.prefill_q_starts, meta.prefill_q_lens, meta.prefill_ctx_lens, meta.prefill_tables = (
            views[f"{prefix}prefills.{name}"] for name in ("q_starts", "q_lens", "ctx_lens", "tables"))
    return meta
