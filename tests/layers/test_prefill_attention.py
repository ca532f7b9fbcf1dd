"""The C prefill attention kernel against the PyTorch reference, on the native and AVX2 builds."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from builds import BUILDS
from pagedllm.layers import kernels
from pagedllm.layers.paged_decode import compiler, paged_decode, run_prefill_kernel

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")


def chunk(q_len, start, block_size, kv_heads, group, head_dim, seed=0):
    """A pool holding a context of start + q_len positions in shuffled blocks, and the chunk's
    queries as a slice of a fused q/k/v projection (rows not contiguous with each other)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = start + q_len
    num_blocks = -(-ctx // block_size) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: -(-ctx // block_size)]
    heads = kv_heads * group
    fused = torch.randn(q_len, heads + 2 * kv_heads, head_dim, generator=gen)
    return fused[:, :heads].view(q_len, kv_heads, group, head_dim), k_cache, v_cache, table


def reference(q, k_cache, v_cache, table, ctx, window, scale):
    """Row r as a decode of the context up to its own position."""
    q_len = q.shape[0]
    lens = torch.arange(ctx - q_len + 1, ctx + 1)
    return paged_decode(q, k_cache, v_cache, table.expand(q_len, -1), lens, window, scale)


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
@pytest.mark.parametrize("window", [0, 5, 23])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("q_len, start", [(1, 0), (7, 0), (16, 0), (40, 0), (17, 13), (33, 50)])
@pytest.mark.parametrize("block_size, head_dim", [(4, 16), (1, 8), (16, 24), (12, 64), (16, 128)])
def test_kernel_matches_reference(build, window, group, q_len, start, block_size, head_dim):
    """Tiles of query rows that are full, partial or one row; contexts and windows ending
    mid-tile; head_dims that are a whole number of vectors, half a vector more, or 8 of them."""
    library = kernels.load(build)
    q, k_cache, v_cache, table = chunk(q_len, start, block_size, 2, group, head_dim)
    out = torch.full(q.shape, float("nan"))
    run_prefill_kernel(q, k_cache, v_cache, table, start + q_len, window, head_dim**-0.5, out, library)
    expected = reference(q, k_cache, v_cache, table, start + q_len, window, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_fresh_prompt_attends_as_causal_sdpa_does():
    q, k_cache, v_cache, table = chunk(50, 0, 16, 2, 2, 32, seed=1)
    out = run_prefill_kernel(q, k_cache, v_cache, table, 50, 0, 32**-0.5, torch.empty(q.shape))
    k = k_cache[table].flatten(0, 1)[:50].transpose(0, 1)  # [Hkv, L, D]
    v = v_cache[table].flatten(0, 1)[:50].transpose(0, 1)
    expected = F.scaled_dot_product_attention(q.flatten(1, 2).transpose(0, 1), k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.flatten(1, 2), expected.transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_the_result_is_written_into_out_and_nowhere_else():
    q, k_cache, v_cache, table = chunk(20, 4, 4, 1, 2, 16, seed=2)
    out = torch.full((22, 2, 16), float("nan"))
    run_prefill_kernel(q, k_cache, v_cache, table, 24, 0, 0.25, out[1:21].view(20, 1, 2, 16))
    assert out[0].isnan().all() and out[21].isnan().all() and not out[1:21].isnan().any()
    torch.testing.assert_close(out[1:21].view(20, 1, 2, 16), reference(q, k_cache, v_cache, table, 24, 0, 0.25), rtol=1e-5, atol=1e-6)


def test_a_head_dim_the_kernel_cannot_vectorise_is_refused():
    q, k_cache, v_cache, table = chunk(3, 0, 4, 1, 1, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        run_prefill_kernel(q, k_cache, v_cache, table, 3, 0, 0.3, torch.empty(q.shape))
