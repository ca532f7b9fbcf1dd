"""The Triton paged-attention kernels against a PyTorch reference: KV writes by slot, decode rows
and prefill chunks over contexts spread across non-contiguous blocks, GQA, sliding windows, block
sizes 1 to 32, padding rows. Without a GPU they run in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), with one natively (`pytest -m cuda` runs the same cases on CUDA).
"""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.layers import triton_attention as ta
from pagedllm.layers.attention import allowed_keys

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="no CUDA device")])]
pytestmark = pytest.mark.skipif(ta.triton is None, reason="Triton is not installed")


def make_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    return k, v


def random_table(rng: random.Random, num_blocks: int, length: int, block_size: int) -> list[int]:
    return rng.sample(range(num_blocks), -(-length // block_size))


def reference(q: torch.Tensor, k_pool, v_pool, table: list[int], q_positions: list[int], window: int | None, scale: float):
    """q: [n, H, D] at q_positions; attends to positions [0, max(q_positions)] of the table's blocks."""
    block_size, kv_heads, head_dim = k_pool.shape[1:]
    length = max(q_positions) + 1
    idx = torch.tensor(table, device=k_pool.device)
    k = k_pool[idx].reshape(-1, kv_heads, head_dim)[:length].double()
    v = v_pool[idx].reshape(-1, kv_heads, head_dim)[:length].double()
    group = q.shape[1] // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    allowed = allowed_keys(torch.tensor(q_positions, device=q.device), torch.arange(length, device=q.device), window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


CASES = [  # (block_size, heads, kv_heads, head_dim, window)
    (16, 4, 2, 16, None),
    (1, 2, 2, 16, None),
    (4, 8, 2, 32, 5),
    (32, 3, 1, 16, None),
    (8, 4, 4, 24, 12),  # head_dim not a power of two
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,window", CASES)
def test_decode_matches_reference(device, block_size, heads, kv_heads, head_dim, window):
    rng = random.Random(block_size * 100 + head_dim)
    num_blocks = 64
    k_pool, v_pool = make_pool(num_blocks, block_size, kv_heads, head_dim, device)
    ctx_lens = [1, 7, 33, 0, 70]  # 0: a padding row, which must come out as zeros
    ctx_lens = [min(c, num_blocks * block_size // 2) for c in ctx_lens]
    tables = [random_table(rng, num_blocks, max(c, 1), block_size) for c in ctx_lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    q = torch.randn(len(ctx_lens), heads + kv_heads, head_dim, device=device)[:, :heads]  # a strided view, as in the model
    out = torch.full((len(ctx_lens), heads, head_dim), float("nan"), device=device)
    scale = head_dim**-0.5
    ta.decode(q, k_pool, v_pool, padded, torch.tensor(ctx_lens, device=device), window or 0, scale, out)
    for row, (ctx, table) in enumerate(zip(ctx_lens, tables)):
        if ctx == 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
            continue
        expected = reference(q[row : row + 1], k_pool, v_pool, table, [ctx - 1], window, scale)[0]
        torch.testing.assert_close(out[row].double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,window", CASES)
def test_prefill_chunks_after_a_prefix_match_reference(device, block_size, heads, kv_heads, head_dim, window):
    rng = random.Random(block_size + head_dim)
    num_blocks = 96
    k_pool, v_pool = make_pool(num_blocks, block_size, kv_heads, head_dim, device)
    # (cached prefix, chunk length): a fresh prompt, a chunk after a prefix, a one-token chunk,
    # a chunk longer than one query tile
    shapes = [(0, 9), (13, 20), (40, 1), (5, 70)]
    tables = [random_table(rng, num_blocks, p + n, block_size) for p, n in shapes]
    starts, row = [], 3  # the chunks follow 3 decode rows, which the kernel must leave alone
    for _, n in shapes:
        starts.append(row)
        row += n
    width = max(len(t) for t in tables)
    meta = ta.TritonAttentionMetadata(
        num_decodes=3, num_prefills=len(shapes), max_prefill_len=max(n for _, n in shapes),
        prefill_q_starts=torch.tensor(starts, device=device), prefill_q_lens=torch.tensor([n for _, n in shapes], device=device),
        prefill_ctx_lens=torch.tensor([p + n for p, n in shapes], device=device),
        prefill_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
    )
    q = torch.randn(row, heads, head_dim, device=device)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    ta.prefill(q, k_pool, v_pool, meta, window or 0, scale, out)
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))
    for (prefix, n), start, table in zip(shapes, starts, tables):
        expected = reference(q[start : start + n], k_pool, v_pool, table, list(range(prefix, prefix + n)), window, scale)
        torch.testing.assert_close(out[start : start + n].double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_fills_slots_and_skips_padding(device):
    k_pool, v_pool = make_pool(8, 4, 2, 16, device)
    before_k, before_v = k_pool.clone(), v_pool.clone()
    kv = torch.randn(4, 6, 16, device=device)  # [T, H + 2 * Hkv, D]: k and v are strided views
    k, v = kv[:, 2:4], kv[:, 4:6]
    slots = torch.tensor([5, -1, 31, 0], device=device)
    ta.write_kv(k, v, k_pool, v_pool, slots)
    flat_k, flat_v = before_k.view(-1, 2, 16).clone(), before_v.view(-1, 2, 16).clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat_k[slot], flat_v[slot] = k[row], v[row]
    assert torch.equal(k_pool.view(-1, 2, 16), flat_k) and torch.equal(v_pool.view(-1, 2, 16), flat_v)


def test_unavailable_reason_names_the_cure():
    reason = ta.unavailable_reason(torch.device("cpu"))
    if reason is not None:  # only without the interpreter
        assert "TRITON_INTERPRET" in reason
    assert ta.unavailable_reason(torch.device("cuda")) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_and_prefill_on_cuda(dtype):
    """The tensor-core path (products in the KV dtype, fp32 accumulation) at a real model's head_dim."""
    rng = random.Random(7)
    k_pool, v_pool = make_pool(256, 16, 8, 64, "cuda", dtype)
    ctx_lens = [1, 300, 1000, 0, 17]
    tables = [random_table(rng, 256, max(c, 1), 16) for c in ctx_lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    q = torch.randn(len(ctx_lens), 32, 64, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    ta.decode(q, k_pool, v_pool, padded, torch.tensor(ctx_lens, device="cuda"), 0, 0.125, out)
    for row, (ctx, table) in enumerate(zip(ctx_lens, tables)):
        if ctx:
            expected = reference(q[row : row + 1], k_pool, v_pool, table, [ctx - 1], None, 0.125)[0]
            torch.testing.assert_close(out[row].double(), expected, atol=2e-2, rtol=2e-2)
    prefix, n = 200, 150
    table = random_table(rng, 256, prefix + n, 16)
    meta = ta.TritonAttentionMetadata(
        num_decodes=0, num_prefills=1, max_prefill_len=n, prefill_q_starts=torch.tensor([0], device="cuda"),
        prefill_q_lens=torch.tensor([n], device="cuda"), prefill_ctx_lens=torch.tensor([prefix + n], device="cuda"),
        prefill_tables=torch.tensor([table], device="cuda"))
    q = torch.randn(n, 32, 64, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    ta.prefill(q, k_pool, v_pool, meta, 0, 0.125, out)
    expected = reference(q, k_pool, v_pool, table, list(range(prefix, prefix + n)), None, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
