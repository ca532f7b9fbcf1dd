"""`pagedllm bench peak`: a device's matmul peak (measured by pagedllm/matmul_peak.py)."""
from __future__ import annotations

import argparse

import torch

from pagedllm.matmul_peak import measure_matmul_peak


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=None, help="matrix size (default: 2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help='element type of the measured matmuls (default: %(default)s)')


def run(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    peak = measure_matmul_peak(args.size, dtype=dtype, device=args.device)
    where = f"{torch.get_num_threads()} threads" if torch.device(args.device).type == "cpu" else torch.cuda.get_device_name(args.device)
    print(f"{args.dtype} matmul peak on {args.device}: {peak / 1e9:.1f} GFLOP/s ({where})")
    return 0
