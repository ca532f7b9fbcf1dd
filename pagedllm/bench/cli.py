"""`pagedllm bench <name>`: each benchmark module exposes `add_arguments(parser)` and `run(args)`."""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, str] = {
    "beam": "pagedllm.bench.beam",
    "decode": "pagedllm.bench.decode",
    "finetune": "pagedllm.bench.finetune",
    "lora": "pagedllm.bench.lora",
    "offline": "pagedllm.bench.offline",
    "peak": "pagedllm.bench.peak",
    "serve": "pagedllm.bench.serve",
    "spec": "pagedllm.bench.spec",
    "startup": "pagedllm.bench.startup",
    "train": "pagedllm.bench.train",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark against an in-run baseline")
    bench_sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sub = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
