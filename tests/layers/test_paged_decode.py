"""The C decode kernel against the PyTorch reference (and the reference against plain SDPA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.paged_decode import compiler, kernel_supported, load, paged_decode, run_kernel

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")


def random_pool(num_blocks=40, block_size=4, kv_heads=2, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), gen


@pytest.mark.parametrize("window", [0, 5, 11])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size, head_dim", [(4, 16), (1, 8), (16, 24), (12, 64)])
def test_kernel_matches_reference(window, group, block_size, head_dim):
    """Blocks shorter and longer than the kernel's 8-row tiles, contexts and windows that end
    mid-tile, and head_dims of 1 to 8 vectors."""
    k_cache, v_cache, gen = random_pool(block_size=block_size, head_dim=head_dim)
    lens = torch.tensor([1, 4, 5, 17, 30, 9, 8, 32])
    nb = -(-32 // block_size)
    tables = torch.stack([torch.randperm(40, generator=gen)[:nb] for _ in lens])
    q = torch.randn(len(lens), 2, group, head_dim, generator=gen)
    ours = run_kernel(q, k_cache, v_cache, tables, lens, window, head_dim**-0.5)
    ref = paged_decode(q, k_cache, v_cache, tables, lens, window, head_dim**-0.5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_a_head_dim_the_kernel_cannot_vectorise_is_refused():
    k_cache, v_cache, _ = random_pool(head_dim=12)
    assert not kernel_supported(k_cache)
    q = torch.randn(1, 2, 1, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        run_kernel(q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]), 0, 0.3)


def test_reference_matches_sdpa_over_the_gathered_context():
    k_cache, v_cache, gen = random_pool()
    table = torch.randperm(40, generator=gen)[:5]
    q = torch.randn(1, 2, 2, 16, generator=gen)
    length = 18
    k = k_cache[table].flatten(0, 1)[:length].transpose(0, 1)  # [Hkv, L, D]
    v = v_cache[table].flatten(0, 1)[:length].transpose(0, 1)
    expected = F.scaled_dot_product_attention(q[0].reshape(4, 1, 16), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0))
    got = paged_decode(q, k_cache, v_cache, table[None], torch.tensor([length]), 0, 16**-0.5)
    torch.testing.assert_close(got.reshape(4, 1, 16), expected, rtol=1e-5, atol=1e-6)


def test_a_sequence_result_does_not_depend_on_the_rest_of_the_batch():
    k_cache, v_cache, gen = random_pool()
    lens = torch.tensor([30, 7, 19])
    tables = torch.stack([torch.randperm(40, generator=gen)[:8] for _ in lens])
    q = torch.randn(3, 2, 2, 16, generator=gen)
    together = run_kernel(q, k_cache, v_cache, tables, lens, 0, 0.25)
    alone = run_kernel(q[1:2], k_cache, v_cache, tables[1:2], lens[1:2], 0, 0.25)
    assert torch.equal(together[1:2], alone)


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """A library linked with -ffast-math would switch on flush-to-zero for the whole process."""
    assert load() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal
    assert (tiny * 1.0).item() != 0.0
    assert 5e-324 * 1.0 > 0.0


def test_q_is_read_in_place_and_the_result_written_into_out():
    """The engine passes q as a slice of the fused q/k projection and a slice of its output."""
    k_cache, v_cache, gen = random_pool()
    lens = torch.tensor([9, 30, 3])
    tables = torch.stack([torch.randperm(40, generator=gen)[:8] for _ in lens])
    fused = torch.randn(3, 2 * 3 + 2, 16, generator=gen)  # 6 query heads, then 2 KV heads
    q = fused[:, :6].view(3, 2, 3, 16)
    out = torch.full((5, 6, 16), float("nan"))
    returned = run_kernel(q, k_cache, v_cache, tables, lens, 0, 0.25, out=out[1:4].view(3, 2, 3, 16))
    assert returned.data_ptr() == out[1].data_ptr()
    torch.testing.assert_close(out[1:4].view(3, 2, 3, 16), paged_decode(q, k_cache, v_cache, tables, lens, 0, 0.25), rtol=1e-5, atol=1e-6)
    assert out[0].isnan().all() and out[4].isnan().all()
