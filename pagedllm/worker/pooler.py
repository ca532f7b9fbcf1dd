"""Embeddings: each prompt's last-token hidden state after the model's final norm, L2-normalized.

Why the last token: a decoder's causal attention lets only the last position see the whole
prompt, so its state is the one summary of it all; vLLM pools decoder models the same way
(`PoolingType.LAST`, normalized) when the model ships no pooler config, and GGUF files ship none.
Mean pooling over a causal model weights the first tokens (which saw almost nothing) as much as
the last.

The forward pass runs the model's modules (the reference path) over the prompts packed one after
another, each attending causally to itself only, and never touches the KV pool: there is no
slot to write (`AttentionMetadata.slot_mapping` is None) and no block to read, so an embedding
shares nothing with — and takes nothing from — the requests the engine is generating for. It runs
on the engine's thread between steps (`LLMEngine.embed`).
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import AttentionMetadata, PrefillChunk, additive_mask, allowed_keys


def no_cache_metadata(lengths: list[int], windows: list[int | None], dtype: torch.dtype,
                      device: torch.device) -> AttentionMetadata:
    """Prompts packed back to back, each one causal chunk with no cached prefix (SDPA's causal
    path); a sliding-window layer gets its window's additive mask per chunk."""
    chunks, start = [], 0
    for length in lengths:
        masks: dict[int | None, torch.Tensor | None] = {None: None}
        for window in windows:
            if window is not None and window < length:
                pos = torch.arange(length, device=device)
                masks[window] = additive_mask(allowed_keys(pos, pos, window), dtype)
        chunks.append(PrefillChunk(q_start=start, q_len=length, ctx_len=length, masks=masks))
        start += length
    return AttentionMetadata(slot_mapping=None, decodes=[], prefills=chunks, kernel_attention=False)


def batches(token_lists: list[list[int]], max_tokens: int) -> Iterator[list[int]]:
    """Indices of `token_lists` grouped so that a group holds at most `max_tokens` tokens (a
    prompt longer than that is a group of its own)."""
    group: list[int] = []
    size = 0
    for index, tokens in enumerate(token_lists):
        if group and size + len(tokens) > max_tokens:
            yield group
            group, size = [], 0
        group.append(index)
        size += len(tokens)
    if group:
        yield group


@torch.inference_mode()
def last_token_states(model: torch.nn.Module, token_lists: list[list[int]], windows: list[int | None],
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[len(token_lists), hidden] float32: the final norm's output at each prompt's last token."""
    lengths = [len(tokens) for tokens in token_lists]
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    meta = no_cache_metadata(lengths, windows, dtype, device)
    hidden = model(ids, positions, meta)
    last = torch.tensor(lengths, device=device).cumsum(0) - 1
    return hidden.index_select(0, last).float()


def pool(model: torch.nn.Module, token_lists: list[list[int]], windows: list[int | None], dtype: torch.dtype,
         device: torch.device, max_batch_tokens: int, normalize: bool = True) -> list[list[float]]:
    """Each prompt's embedding (last-token pooling, L2-normalized unless `normalize` is False),
    in the prompts' order, computed in forward passes of at most `max_batch_tokens` tokens."""
    out: list[list[float]] = [[] for _ in token_lists]
    for group in batches(token_lists, max_batch_tokens):
        states = last_token_states(model, [token_lists[i] for i in group], windows, dtype, device)
        if normalize:
            states = F.normalize(states, p=2, dim=-1)
        for index, row in zip(group, states.cpu().tolist()):
            out[index] = row
    return out
