"""The arithmetic peaks the benchmarks' limits and shares are taken against."""
from __future__ import annotations

import pytest

from pagedllm.layers import kernels
from pagedllm.matmul_peak import measure_cpu_peak, measure_matmul_peak

needs_cc = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")


@needs_cc
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_the_kernel_peaks_count_each_instruction_s_operations(build):
    """One thread: an int8 dot-product instruction does 4x (vpdpbusd, 4 products a lane) or 2x
    (vpmaddubsw, 2 a 16-bit lane) the multiply-adds of an fp32 FMA of the same width, and issues
    at least half as often, so the int8 peak is at least the fp32 one; a miscounted loop (or one
    the compiler folded away) breaks the ratio or the plausible range."""
    library = kernels.load(kernels.ISA_FLAGS[build])
    fp32, int8 = (library.arithmetic_peak(kind, 200_000, 2, 1) for kind in (0, 1))
    assert 4e9 < fp32 < 1e12  # 1-2 FMAs of 8-16 lanes a cycle at 1-5 GHz
    if kernels.isa(library) != "generic":
        assert fp32 <= int8 < 10 * fp32


@needs_cc
def test_the_cpu_peak_is_at_least_torch_s_matmul_and_int8_at_least_fp32():
    fp32 = measure_cpu_peak()
    assert fp32 >= 0.5 * measure_matmul_peak(size=512, repeats=2)  # the better of the two (a loaded machine moves either)
    assert measure_cpu_peak(int8=True) >= 0.5 * fp32
