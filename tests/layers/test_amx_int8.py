"""Int8-activation matmuls of many rows through the AMX tiles (csrc/amx_int8.c): the tiles give
the same integer sums as VNNI, and small_matmul.c runs the same epilogue over them, so a build
with AMX must give the bits of the same build without it (-mno-amx-*), for every row count on
either side of the tiles' threshold, every kind of block, with a bias and for gate/up weights.
Runs where this machine's kernels use the tiles."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from pagedllm.layers import kernels
from pagedllm.layers.quantization import quantize_blocks
from pagedllm.layers.small_matmul import matmul, pack_blocks, pack_swiglu

NO_AMX = ("-mno-amx-tile", "-mno-amx-int8")

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")


def _cpu_has_amx() -> bool:
    flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
    return bool(flags) and {"amx_tile", "amx_int8"} <= set(flags[0].split())


def _kernel_grants_amx() -> bool:
    """Linux hands out the tiles' state on request from 5.16 on."""
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 16)


@pytest.fixture(scope="module")
def amx():
    library = kernels.load()
    if library.int8_dot_product().decode() != "amx":
        pytest.skip("this machine's kernels do not use AMX tiles")
    return library


def test_the_tiles_are_used_where_the_machine_has_them():
    library = kernels.load()
    expected = "amx" if _cpu_has_amx() and _kernel_grants_amx() and kernels.isa(library) == "avx512" else None
    if expected is None:
        pytest.skip("no AMX-INT8 on this machine")
    assert library.int8_dot_product().decode() == expected
    assert kernels.load(NO_AMX).int8_dot_product().decode() != "amx"


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["matmul", "swiglu"])
def test_amx_gives_the_bits_of_vnni(amx, kind, swiglu):
    vnni = kernels.load(NO_AMX)
    gen = torch.Generator().manual_seed(len(kind) + swiglu)
    n, k = (2 * 53, 288) if swiglu else (53, 608)  # partial last panels; 9 and 19 blocks (the tiles take 8 at a time)
    blocks = quantize_blocks(torch.randn(n, k, generator=gen), kind)
    bias = torch.randn(n, generator=gen)
    packed = dataclasses.replace((pack_swiglu if swiglu else pack_blocks)(blocks, amx.panel_width(), bias), int8_activations=True)
    x = torch.randn(150, k, generator=gen) * torch.linspace(0.01, 10, 150)[:, None]
    x[20, :64] = 0.0  # blocks of zeros: scale 0
    for m in (15, 16, 17, 31, 33, 64, 65, 79, 150):
        for threads in (1, 2):
            assert torch.equal(matmul(amx, x[:m], packed, threads), matmul(vnni, x[:m], packed, threads)), f"m={m} threads={threads}"
