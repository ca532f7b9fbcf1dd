"""The small-M matmul kernel (fp32, int8 and GGUF-block panels) against `x @ W^T`, on the AVX-512 build where
the machine has it and on the AVX2 build everywhere (-mno-avx512f), so CI machines without
AVX-512 run the same code paths as this one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from builds import BUILDS
from pagedllm.layers import kernels
from pagedllm.layers.quantization import dequantize_int8, quantize_blocks, quantize_int8
from pagedllm.layers.small_matmul import MAX_ROWS, matmul, pack, pack_blocks, pack_swiglu

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")

# (n, k): fewer channels than a panel, a partial last panel, odd k, the model's shapes.
SHAPES = [(3, 5), (37, 13), (17, 64), (960, 576), (576, 1536)]


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 summation of k products: each partial sum rounds with relative error 2^-24, so the
    error is at most ~k * 2^-24 * sum_k |x_k w_k| (a loose worst case; typical is sqrt(k) times
    smaller). Per output element."""
    k = x.shape[1]
    return (x.abs().double() @ w.abs().double().T) * k * 2.0**-24 + 1e-30


@pytest.mark.parametrize("n, k", SHAPES)
def test_fp32_matches_reference_for_every_batch_size(library, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = pack(w, library.panel_width(), b)
    x = torch.randn(MAX_ROWS, k, generator=gen)
    for m in range(1, MAX_ROWS + 1):
        ours = matmul(library, x[:m], packed)
        exact = x[:m].double() @ w.double().T + b.double()
        assert ((ours.double() - exact).abs() <= bound(x[:m], w) + 1e-6).all(), f"m={m}"


def test_a_row_does_not_depend_on_the_rest_of_the_batch(library):
    """The summation order of a row is fixed (k in order, even/odd chains), whatever M is."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(100, 70, generator=gen), torch.randn(16, 70, generator=gen)
    packed = pack(w, library.panel_width())
    alone = torch.cat([matmul(library, x[i : i + 1], packed) for i in range(16)])
    assert torch.equal(alone, matmul(library, x, packed))


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["matmul", "swiglu"])
def test_panel_pairs_give_a_row_the_bits_of_its_1_row_product(library, int8, swiglu):
    """Weights that fit in the cache are read two panels at a time for some row counts (2-6 rows
    on AVX-512, every count on AVX2; small_matmul.c): every batch size must still give each row
    the bits of that row alone, with an odd number of panels (the last one partial, computed
    alone), odd k, bias, int8 scales, gate/up pairs, and thread shares that split a matrix into
    odd runs of panels."""
    width = library.panel_width()
    gen = torch.Generator().manual_seed(4)
    n = 2 * (6 * width + 5) if swiglu else 6 * width + 5  # 7 panels (or gate/up pairs), the last partial
    w, b = torch.randn(n, 37, generator=gen), torch.randn(n, generator=gen)
    scale = None
    if int8:
        w, scale = quantize_int8(w)
    packed = (pack_swiglu if swiglu else pack)(w, width, b, scale)
    x = torch.randn(MAX_ROWS, 37, generator=gen)
    for threads in (1, 2, 3):
        alone = torch.cat([matmul(library, x[i : i + 1], packed, threads) for i in range(MAX_ROWS)])
        for m in range(2, MAX_ROWS + 1):
            assert torch.equal(matmul(library, x[:m], packed, threads), alone[:m]), f"m={m} threads={threads}"


def test_avx2_and_avx512_builds_give_the_same_bits():
    native, avx2 = kernels.load(), kernels.load(BUILDS["avx2"])
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(53, 77, generator=gen), torch.randn(MAX_ROWS, 77, generator=gen)
    q, s = quantize_int8(w)
    for lib_a, lib_b in ((native, avx2),):
        for m in (1, 2, 4, 5, 8, MAX_ROWS):  # single panels and pairs, in different passes on each
            assert torch.equal(matmul(lib_a, x[:m], pack(w, lib_a.panel_width())), matmul(lib_b, x[:m], pack(w, lib_b.panel_width())))
            assert torch.equal(matmul(lib_a, x[:m], pack(q, lib_a.panel_width(), None, s)),
                               matmul(lib_b, x[:m], pack(q, lib_b.panel_width(), None, s)))


@pytest.mark.parametrize("intermediate", [8, 37, 96])
def test_swiglu_matches_silu_gate_times_up(library, intermediate):
    gen = torch.Generator().manual_seed(intermediate)
    w, b = torch.randn(2 * intermediate, 24, generator=gen), torch.randn(2 * intermediate, generator=gen)
    x = torch.randn(9, 24, generator=gen)
    gate, up = F.linear(x.double(), w.double(), b.double()).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    for m in (1, 4, 9):
        ours = matmul(library, x[:m], pack_swiglu(w, library.panel_width(), b))
        torch.testing.assert_close(ours.double(), expected[:m], rtol=2e-5, atol=2e-5)


def test_int8_dequantized_weights_are_within_half_a_step_of_the_original():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 200, generator=gen) * torch.linspace(0.01, 3, 64)[:, None]
    w[5] = 0.0  # an all-zero channel
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q[5], torch.zeros_like(q[5])) and scale[5] == 1
    assert torch.all(q.abs().amax(dim=1)[scale != 1] == 127)  # each channel uses the full range
    error = (dequantize_int8(q, scale) - w).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("n, k", SHAPES)
def test_int8_matmul_is_within_the_quantization_bound_of_fp32(library, n, k):
    """Against the fp32 product with the original weights: each weight is off by at most half
    its channel's step (scale / 2), so an output is off by at most (scale_c / 2) * sum_k |x_k|
    plus the fp32 rounding bound — and against the dequantized weights only by the rounding."""
    gen = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    q, scale = quantize_int8(w)
    packed = pack(q, library.panel_width(), b, scale)
    x = torch.randn(MAX_ROWS, k, generator=gen)
    for m in (1, 2, 7, MAX_ROWS):
        ours = matmul(library, x[:m], packed).double()
        fp32 = x[:m].double() @ w.double().T + b.double()
        quant_bound = x[:m].abs().double().sum(dim=1, keepdim=True) * scale.double()[None, :] / 2
        assert ((ours - fp32).abs() <= quant_bound + bound(x[:m], w) + 1e-6).all()
        dequantized = x[:m].double() @ dequantize_int8(q, scale).double().T + b.double()
        assert ((ours - dequantized).abs() <= bound(x[:m], w) * 2 + 1e-6).all()


def test_an_int8_weight_needs_its_scales(library):
    with pytest.raises(ValueError, match="scales"):
        pack(torch.zeros(4, 4, dtype=torch.int8), library.panel_width())
    with pytest.raises(ValueError, match="float32"):
        matmul(library, torch.zeros(2, 5), pack(torch.zeros(4, 4), library.panel_width()))


BLOCK_SHAPES = [(3, 32), (37, 64), (17, 96), (960, 576), (576, 1536)]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n, k", BLOCK_SHAPES)
def test_gguf_blocks_match_the_dequantized_reference(library, kind, n, k):
    """GGUF blocks kept bit for bit in panels: every batch size (and prefill-sized ones, past a
    tile of 64 rows) gives
    x @ W^T of the weights gguf dequantizes them to, within fp32 summation error; a row does not
    depend on the rest of the batch."""
    gen = torch.Generator().manual_seed(n + k)
    blocks = quantize_blocks(torch.randn(n, k, generator=gen), kind)
    w, b = blocks.dequantize(), torch.randn(n, generator=gen)
    packed = pack_blocks(blocks, library.panel_width(), b)
    width = library.panel_width()  # a block's bytes as GGUF's Q8_0 / Q4_1 (Q4_0 gains its min): 34 or 20 per 32 weights
    assert packed.panels.numel() == -(-n // width) * width * (k // 32) * (34 if kind == "Q8_0" else 20)
    x = torch.randn(130, k, generator=gen)  # 130 rows: a prefill in tiles of 64 (ROW_TILE), 2 left over
    alone = torch.cat([matmul(library, x[i : i + 1], packed) for i in range(x.shape[0])])
    for m in [*range(1, MAX_ROWS + 1), 40, 130]:
        ours = matmul(library, x[:m], packed)
        exact = x[:m].double() @ w.double().T + b.double()
        assert ((ours.double() - exact).abs() <= bound(x[:m], w) + 1e-6).all(), f"m={m}"
        assert torch.equal(ours, alone[:m]), f"m={m}"


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_blocks_swiglu(library, kind):
    gen = torch.Generator().manual_seed(7)
    n, k = 2 * (3 * library.panel_width() + 5), 64
    blocks = quantize_blocks(torch.randn(n, k, generator=gen) * 0.2, kind)
    packed = pack_swiglu(blocks, library.panel_width())
    x = torch.randn(5, k, generator=gen)
    gate, up = (x.double() @ blocks.dequantize().double().T).chunk(2, dim=-1)
    torch.testing.assert_close(matmul(library, x, packed).double(), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    fp32 = pack_swiglu(blocks.dequantize(), library.panel_width())
    torch.testing.assert_close(matmul(library, x, packed), matmul(library, x, fp32), rtol=1e-5, atol=1e-5)


def test_q4_0_blocks_are_kept_as_q4_1_with_the_same_values(library):
    """Q4_0 (w = d (q - 8)) is packed as Q4_1 with m = -8 d: the same weights, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    blocks = quantize_blocks(torch.randn(16, 64, generator=gen), "Q4_0")
    eye = torch.eye(64)
    packed = pack_blocks(blocks, library.panel_width())
    assert torch.equal(matmul(library, eye, packed).T, blocks.dequantize())  # x = I reads the weights back exactly
