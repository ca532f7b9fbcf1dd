"""Half-width KV pools (kv_cache_dtype="bfloat16" or "float16") read by the C attention kernels:
each element is widened exactly as it is loaded, so attention over a half pool must give the very
bits of attention over a float32 pool holding the same (rounded) values — for decode (every row
count, windows, head_dims of 1 to 8 vectors) and prefill (both builds). And the fused step writes
new K/V rounded as torch's .to() rounds: tests/models/test_fused_decode.py."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.paged_decode import compiler, run_kernel, run_prefill_kernel

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
HALVES = [torch.bfloat16, torch.float16]


def pools(dtype: torch.dtype, block_size: int, head_dim: int, kv_heads: int = 2, num_blocks: int = 40, seed: int = 0):
    """(half K, half V, the same values as float32 K and V, generator). Values up to ~4e4 in
    float16 (past bfloat16's 8 bits, within float16's range) and subnormal ones: every exponent
    the widening must handle."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen) for _ in range(2))
    if dtype == torch.float16:
        k[0, 0, 0, :4] = torch.tensor([4e4, -3e-6, 6e-8, 0.0])
        v[1, 0, 1, :4] = torch.tensor([-5e4, 2e-7, -1e-5, 1.0 + 2**-10])
    k, v = k.to(dtype), v.to(dtype)
    return k, v, k.float(), v.float(), gen


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size, head_dim", [(4, 16), (1, 8), (16, 24), (12, 64)])
def test_decode_over_a_half_pool_is_the_float32_pool_of_its_values(dtype, window, group, block_size, head_dim):
    k16, v16, k32, v32, gen = pools(dtype, block_size, head_dim)
    lens = torch.tensor([1, 4, 5, 17, 30, 9, 8, 32])
    tables = torch.stack([torch.randperm(40, generator=gen)[: -(-32 // block_size)] for _ in lens])
    tables[:, 0] = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # the blocks holding the extreme values
    q = torch.randn(len(lens), 2, group, head_dim, generator=gen) * 1e-4  # so 4e4 * q does not saturate every score
    ours = run_kernel(q, k16, v16, tables, lens, window, head_dim**-0.5)
    assert torch.equal(ours, run_kernel(q, k32, v32, tables, lens, window, head_dim**-0.5))


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("q_len, start", [(1, 0), (17, 13), (40, 0)])
@pytest.mark.parametrize("block_size, head_dim", [(4, 16), (16, 24), (16, 128)])
def test_prefill_over_a_half_pool_is_the_float32_pool_of_its_values(library, dtype, window, q_len, start, block_size,
                                                                       head_dim):
    k16, v16, k32, v32, gen = pools(dtype, block_size, head_dim)
    ctx = start + q_len
    table = torch.randperm(40, generator=gen)[: -(-ctx // block_size)]
    table[0] = 0
    q = torch.randn(q_len, 2, 3, head_dim, generator=gen) * 1e-4
    outs = [run_prefill_kernel(q, k, v, table, ctx, window, head_dim**-0.5, torch.empty_like(q), library)
            for k, v in ((k16, v16), (k32, v32))]
    assert torch.equal(*outs)


def test_the_two_halves_are_not_read_as_each_other():
    """The same bits read as the other type give other values: each kernel widens its own type."""
    k16, v16, _, _, gen = pools(torch.float16, 4, 16)
    lens, tables = torch.tensor([7]), torch.arange(2).view(1, 2)
    q = torch.randn(1, 2, 1, 16, generator=gen)
    as_half = run_kernel(q, k16, v16, tables, lens, 0, 0.25)
    as_bf16 = run_kernel(q, k16.view(torch.bfloat16), v16.view(torch.bfloat16), tables, lens, 0, 0.25)
    assert not torch.equal(as_half, as_bf16)


def test_mixed_or_unknown_pools_are_refused():
    k16, v16, k32, _, _ = pools(torch.bfloat16, 4, 16)
    q = torch.randn(1, 2, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        run_kernel(q, k16, k32, table, lens, 0, 0.25)  # K and V of different types
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        run_kernel(q, k16.half(), v16, table, lens, 0, 0.25)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        run_kernel(q, k16.double(), v16.double(), table, lens, 0, 0.25)
