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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
