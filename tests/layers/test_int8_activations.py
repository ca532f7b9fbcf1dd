"""Block-quantized weights with int8 activations (Matrix.int8_activations, csrc/small_matmul.c):
each row's activations quantized to int8 per block of 32 and multiplied by the weights' codes
with integer dot products, llama.cpp's Q8_1 way. Against a PyTorch reference that quantizes the
activations the same way and sums the products exactly (integers), so only the fp32 epilogue
(a block's scale times its integer sum, accumulated over the blocks) is left to a tolerance; on
the AVX-512 build where the machine has it (VNNI) and on the AVX2 build, which must give the
same bits; a row's result does not depend on the rest of the batch."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from builds import BUILDS
from pagedllm.layers import kernels
from pagedllm.layers.quantization import Blocks, quantize_blocks
from pagedllm.layers.small_matmul import MAX_ROWS, matmul, pack, pack_blocks, pack_swiglu

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")

KINDS = ["Q4_0", "Q4_1", "Q8_0"]
# (n, k): k a multiple of 32 of several sizes, fewer channels than a panel, partial last panels, the model's shapes
SHAPES = [(3, 32), (37, 64), (17, 96), (960, 576), (576, 1536)]


def int8_packed(blocks: Blocks, width: int, bias: torch.Tensor | None = None, swiglu: bool = False):
    packed = (pack_swiglu if swiglu else pack_blocks)(blocks, width, bias)
    return dataclasses.replace(packed, int8_activations=True)


def quantize_activations(x: torch.Tensor):
    """The kernel's quantization of x [m, k] (fp32 operations in the same order): per block of 32,
    amax = max |x|, q = round_half_even(x * (127 * (1 / amax))), d = amax * (1 / 127), s = d * sum(q)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 1.0 / amax, torch.zeros_like(amax))
    scale_up = inv * torch.tensor(127.0)
    q = torch.round(xb * scale_up[..., None])
    assert q.abs().max() <= 127
    d = amax * torch.tensor(1 / 127, dtype=torch.float32)
    total = q.sum(dim=-1)
    return q, d, d * total


def block_codes(blocks: Blocks):
    """The weights' integer codes [n, nb, 32], scales d [n, nb] and minimums m [n, nb] (None for Q8_0)."""
    n = blocks.rows.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[blocks.kind]
    raw = blocks.rows.reshape(n, -1, size)
    d = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]
    if blocks.kind == "Q8_0":
        return torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).astype(np.int64)), torch.from_numpy(d.astype(np.float32)), None
    if blocks.kind == "Q4_1":
        m, qs = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0], raw[..., 4:]
    else:
        m, qs = np.float16(-8) * d, raw[..., 2:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    return torch.from_numpy(codes), torch.from_numpy(d.astype(np.float32)), torch.from_numpy(m.astype(np.float32))


def reference(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None):
    """The product with the activations quantized as the kernel does, its integer sums exact:
    (value in float64, bound of the fp32 epilogue's rounding)."""
    xq, dx, sx = quantize_activations(x)
    codes, dw, mw = block_codes(blocks)
    isum = torch.einsum("rbi,cbi->rcb", xq.double(), codes.double())  # exact: |sums| < 2^53
    scale = (dw[None, :, :] * dx[:, None, :]).double()  # the kernel's fp32 d_w * d_x
    terms = scale * isum
    if mw is not None:
        terms = torch.cat([terms, mw.double()[None] * sx.double()[:, None, :]], dim=-1)
    value = terms.sum(dim=-1)
    nb = codes.shape[1]
    error = terms.abs().sum(dim=-1) * (nb + 2) * 2.0**-24
    if bias is not None:
        value = value + bias.double()
        error = error + bias.double().abs() * 2.0**-24
    return value, error + 1e-30


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_int8_activations_match_the_integer_reference(library, kind, n, k):
    """Every row count 1..16 (and prefill-sized ones, past a tile of 64 rows): the reference
    within the epilogue's rounding; each row the bits of that row alone."""
    gen = torch.Generator().manual_seed(n * k + len(kind))
    blocks = quantize_blocks(torch.randn(n, k, generator=gen), kind)
    b = torch.randn(n, generator=gen)
    packed = int8_packed(blocks, library.panel_width(), b)
    x = torch.randn(130, k, generator=gen) * torch.linspace(0.01, 10, 130)[:, None]
    x[3, :32] = 0.0  # a block of zeros: scale 0, every code 0
    expected, error = reference(x, blocks, b)
    alone = torch.cat([matmul(library, x[i : i + 1], packed) for i in range(x.shape[0])])
    assert ((alone.double() - expected).abs() <= error).all()
    for m in [*range(1, MAX_ROWS + 1), 40, 130]:
        assert torch.equal(matmul(library, x[:m], packed), alone[:m]), f"m={m}"
    for threads in (1, 2, 3):
        assert torch.equal(matmul(library, x[:MAX_ROWS], packed, threads), alone[:MAX_ROWS]), f"threads={threads}"


@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_stay_close_to_the_exact_product(library, kind):
    """The activations' rounding (half a step of max|x| / 127 per block) moves an output by a
    small fraction of its magnitude: within 2 % of sum |x w| here."""
    gen = torch.Generator().manual_seed(11)
    blocks = quantize_blocks(torch.randn(64, 576, generator=gen), kind)
    x = torch.randn(MAX_ROWS, 576, generator=gen)
    w = blocks.dequantize()
    ours = matmul(library, x, int8_packed(blocks, library.panel_width())).double()
    exact = x.double() @ w.double().T
    assert ((ours - exact).abs() <= 0.02 * (x.abs().double() @ w.abs().double().T)).all()
    assert not torch.equal(ours, matmul(library, x, pack_blocks(blocks, library.panel_width())).double())  # the mode is on


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_int8_activations_swiglu(library, kind):
    gen = torch.Generator().manual_seed(7)
    n, k = 2 * (3 * library.panel_width() + 5), 64
    blocks = quantize_blocks(torch.randn(n, k, generator=gen) * 0.2, kind)
    x = torch.randn(MAX_ROWS, k, generator=gen)
    expected, error = reference(x, blocks, None)
    gate, up = expected.chunk(2, dim=-1)
    packed = int8_packed(blocks, library.panel_width(), swiglu=True)
    ours = matmul(library, x, packed).double()
    torch.testing.assert_close(ours, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    alone = torch.cat([matmul(library, x[i : i + 1], packed) for i in range(MAX_ROWS)])
    for m in range(1, MAX_ROWS + 1):
        assert torch.equal(matmul(library, x[:m], packed), alone[:m]), f"m={m}"


@pytest.mark.parametrize("swiglu", [False, True], ids=["matmul", "swiglu"])
@pytest.mark.parametrize("kind", KINDS)
def test_avx2_and_avx512_builds_give_the_same_bits(kind, swiglu):
    native, avx2 = kernels.load(), kernels.load(BUILDS["avx2"])
    gen = torch.Generator().manual_seed(5)
    n = 2 * 53 if swiglu else 53
    blocks = quantize_blocks(torch.randn(n, 96, generator=gen), kind)
    b = torch.randn(n, generator=gen)
    x = torch.randn(MAX_ROWS, 96, generator=gen) * 3
    a_packed = int8_packed(blocks, native.panel_width(), b, swiglu)
    b_packed = int8_packed(blocks, avx2.panel_width(), b, swiglu)
    for m in range(1, MAX_ROWS + 1):
        assert torch.equal(matmul(native, x[:m], a_packed), matmul(avx2, x[:m], b_packed)), f"m={m}"


def test_the_flag_is_only_passed_for_block_weights(library):
    """fp32 and int8 panels keep their exact path: the struct carries the flag only for Q4/Q8_0."""
    packed = dataclasses.replace(pack(torch.randn(8, 32), library.panel_width()), int8_activations=True)
    assert packed.struct().int8_activations == 0
    blocks = int8_packed(quantize_blocks(torch.randn(8, 32), "Q4_1"), library.panel_width())
    assert blocks.struct().int8_activations == 1
