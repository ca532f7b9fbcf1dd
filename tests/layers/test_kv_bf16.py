"""A bfloat16 KV pool (kv_cache_dtype="bfloat16") read by the C attention kernels: each element is
widened exactly as it is loaded, so attention over a bf16 pool must give the very bits of
attention over a float32 pool holding the same (bf16-rounded) values — for decode (every row
count, windows, head_dims of 1 to 8 vectors) and prefill (both builds)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.paged_decode import compiler, run_kernel, run_prefill_kernel

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")


def pools(block_size: int, head_dim: int, kv_heads: int = 2, num_blocks: int = 40, seed: int = 0):
    """(bf16 K, bf16 V, the same values as float32 K and V, generator)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2))
    return k, v, k.float(), v.float(), gen


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size, head_dim", [(4, 16), (1, 8), (16, 24), (12, 64)])
def test_decode_over_bf16_is_the_float32_pool_of_its_values(window, group, block_size, head_dim):
    k16, v16, k32, v32, gen = pools(block_size, head_dim)
    lens = torch.tensor([1, 4, 5, 17, 30, 9, 8, 32])
    tables = torch.stack([torch.randperm(40, generator=gen)[: -(-32 // block_size)] for _ in lens])
    q = torch.randn(len(lens), 2, group, head_dim, generator=gen)
    ours = run_kernel(q, k16, v16, tables, lens, window, head_dim**-0.5)
    assert torch.equal(ours, run_kernel(q, k32, v32, tables, lens, window, head_dim**-0.5))


@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("q_len, start", [(1, 0), (17, 13), (40, 0)])
@pytest.mark.parametrize("block_size, head_dim", [(4, 16), (16, 24), (16, 128)])
def test_prefill_over_bf16_is_the_float32_pool_of_its_values(library, window, q_len, start, block_size, head_dim):
    k16, v16, k32, v32, gen = pools(block_size, head_dim)
    ctx = start + q_len
    table = torch.randperm(40, generator=gen)[: -(-ctx // block_size)]
    q = torch.randn(q_len, 2, 3, head_dim, generator=gen)
    outs = [run_prefill_kernel(q, k, v, table, ctx, window, head_dim**-0.5, torch.empty_like(q), library)
            for k, v in ((k16, v16), (k32, v32))]
    assert torch.equal(*outs)


def test_mixed_or_half_precision_pools_are_refused():
    k16, v16, k32, _, _ = pools(4, 16)
    q = torch.randn(1, 2, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        run_kernel(q, k16, k32, table, lens, 0, 0.25)  # K and V of different types
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        run_kernel(q, k16.half(), v16.half(), table, lens, 0, 0.25)
