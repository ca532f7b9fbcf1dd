"""Measure this machine's fp32 matmul peak, the denominator of every MFU / share-of-peak figure."""
from __future__ import annotations

import argparse
import time

import torch


def measure_matmul_peak(size: int = 2048, repeats: int = 8, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-`repeats` FLOP/s of a square matmul: the practical ceiling for dense compute here."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=2048)


def run(args: argparse.Namespace) -> int:
    peak = measure_matmul_peak(args.size)
    print(f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    return 0
