"""The `pagedllm` command: one sub-command per entry point.

Each module listed in COMMANDS exposes `register(subparsers)`, which adds its sub-command
and sets `func` on the parser it creates. Modules are imported lazily so that `pagedllm
--help` does not pay for torch, FastAPI and the trainer all at once.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: list[str] = [
    "pagedllm.entrypoints.generate",
    "pagedllm.entrypoints.serve",
    "pagedllm.bench.cli",
    "pagedllm.training.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
