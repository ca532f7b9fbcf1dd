"""A device's measured matmul peak: the denominator of every MFU / share-of-peak figure (the
trainer's MFU, the benchmarks' shares).

Measured where the work runs and in its compute dtype: an fp32 CPU peak is no yardstick for a
bf16 run on a GPU (that mismatch once printed an MFU of 4300 %).
"""
from __future__ import annotations

import time

import torch


def measure_matmul_peak(size: int | None = None, repeats: int = 8, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> float:
    """Best-of-`repeats` FLOP/s of a square matmul: the practical ceiling for dense compute there."""
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def measure_cpu_peak(int8: bool = False, num_threads: int | None = None) -> float:
    """Operations/s a CPU step can reach in the dtype it computes in: for fp32 the better of
    torch's matmul and the kernel library's register-only FMA chains (torch's BLAS may not use
    every vector width the CPU has: on a Zen 5 EPYC its fp32 matmul ran at half the FMA peak, and
    the engine's own kernels' prefill measured above it), for int8 activations the library's
    int8 dot-product peak (vpdpbusd / vpmaddubsw). Without the library: torch's fp32 matmul."""
    from pagedllm.layers import kernels

    threads = num_threads or torch.get_num_threads()
    library = kernels.load()
    int8_peak = library.arithmetic_peak(1, _PEAK_ROUNDS, 3, threads) if int8 and library else 0.0
    if int8_peak:  # the fp32 peak is only the fallback of a build without int8 dot products
        return int8_peak
    return max(measure_matmul_peak(), library.arithmetic_peak(0, _PEAK_ROUNDS, 3, threads) if library else 0.0)


_PEAK_ROUNDS = 2_000_000  # ~25 ms a pass on one Zen 5 core


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
