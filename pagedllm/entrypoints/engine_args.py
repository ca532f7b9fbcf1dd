"""Engine arguments as command-line flags, generated from `EngineConfig`'s fields.

Shared by every command that builds an engine (`serve`, `generate`, benchmarks), so a new engine
argument becomes a flag everywhere at once.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.config.engine import KV_CACHE_DTYPES, PREEMPTION_POLICIES

_NOT_FLAGS = {"model", "extra"}
# Flags whose values are a fixed set: argparse names them in --help and refuses others early.
_CHOICES = {"preemption_policy": PREEMPTION_POLICIES, "preemption_mode": ("recompute", "swap"), "kv_cache_dtype": KV_CACHE_DTYPES}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-num-seqs, --enable-prefix-caching/--no-...);
    defaults stay None so that only the flags given override the engine's own defaults."""
    group = parser.add_argument_group("engine arguments (per loaded model)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        default = f.default if f.default is not dataclasses.MISSING else None
        if kind in ("bool", "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"default: {default}")
        else:
            convert = int if "int" in kind else float if "float" in kind else str
            choices = _CHOICES.get(f.name)
            group.add_argument(flag, type=convert, default=None, choices=choices,
                               metavar=None if choices else f.name.upper(), help=f"default: {default}")


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in _NOT_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
