"""The `pagedllm` command: one sub-command per entry point.

Each module listed in COMMANDS exposes `register(subparsers)`, which adds its sub-command
and sets `func` on the parser it creates. Modules are imported lazily so that `pagedllm
--help` does not pay for torch, FastAPI and the trainer all at once.

An expected error (a bad argument or config value, a model that cannot load, a missing file:
ValueError and FileNotFoundError, which ModelLoadError, ConfigError and DefaultModelMissing are)
is one line on stderr and exit code 2, as argparse's own; PAGEDLLM_DEBUG=1 shows its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

EXIT_USAGE = 2  # argparse's code for a bad command line
EXPECTED_ERRORS = (ValueError, FileNotFoundError)

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


def one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EXPECTED_ERRORS as exc:
        if os.environ.get("PAGEDLLM_DEBUG"):
            raise
        print(f"pagedllm {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
