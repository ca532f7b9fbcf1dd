"""Measure a device's matmul peak, the denominator of every MFU / share-of-peak figure.

Measured where the work runs and in its compute dtype: an fp32 CPU peak is no yardstick for a
bf16 run on a GPU (that mismatch once printed an MFU of 4300 %).
"""
from __future__ import annotations

import argparse
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=None, help="matrix size (default: 2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    peak = measure_matmul_peak(args.size, dtype=dtype, device=args.device)
    where = f"{torch.get_num_threads()} threads" if torch.device(args.device).type == "cpu" else torch.cuda.get_device_name(args.device)
    print(f"{args.dtype} matmul peak on {args.device}: {peak / 1e9:.1f} GFLOP/s ({where})")
    return 0
