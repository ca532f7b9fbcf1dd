"""`pagedllm bench train --fp8` and `--nvme-offload`: FP8 against BF16, NVMe offload against cpu_offload.

--fp8: the same job (bench train's model and data) trained in BF16 and in FP8 with each torchao recipe,
one process each: tokens/s, and the largest per-step relative loss difference from BF16. On a CPU the
float8 matmuls are emulated (training/fp8.py): the loss columns are the point, the speed is not (the
emulation is slower than BF16 by construction). On a GPU of compute capability >= 8.9 both matter.

--nvme-offload: one training step's peak RSS (pagedllm.bench.step_memory, a fresh process per
configuration) with cpu_offload and with nvme_offload, against the optimizer states' size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

MIB = 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8", action="store_true", help="FP8 (tensorwise, rowwise) against BF16: loss difference, tokens/s")
    parser.add_argument("--nvme-offload", action="store_true", help="one step's peak RSS: nvme_offload against cpu_offload")


def wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "fp8", False) or getattr(args, "nvme_offload", False))


def run(args: argparse.Namespace, bench_job: Callable, prepare: Callable, run_config: Callable, work: Path, device: str) -> dict:
    prepare(work)
    out: dict = {"device": device}
    if args.fp8:
        out["fp8"] = compare_fp8(args, bench_job, run_config, work, device)
    if args.nvme_offload:
        out["nvme_offload"] = compare_offload(args, bench_job, work)
    return out


def compare_fp8(args, bench_job: Callable, run_config: Callable, work: Path, device: str) -> list[dict]:
    rows, baseline = [], None
    for name, memory in (("BF16", {"precision": "BF16"}), ("FP8 tensorwise", {"precision": "FP8", "fp8_recipe": "tensorwise"}),
                         ("FP8 rowwise", {"precision": "FP8", "fp8_recipe": "rowwise"})):
        job = bench_job(args, work, name.replace(" ", "-"), 0)
        job["memory_config"].update(memory)
        records = run_config(job, work, 1, 1e12, device)
        losses = [r["loss"] for r in records]
        row = {"config": name, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[args.warmup_steps:]),
               "first_loss": losses[0], "last_loss": losses[-1]}
        if baseline is None:
            baseline = losses
        else:
            row["max_rel_loss_diff"] = max(abs(a - b) / b for a, b in zip(losses, baseline))
        rows.append(row)
    return rows


def compare_offload(args, bench_job: Callable, work: Path) -> list[dict]:
    rows = []
    for name, memory in (("cpu_offload", {"cpu_offload": True}), ("nvme_offload", {"nvme_offload": True})):
        job = bench_job(args, work, name, 3)
        job["memory_config"].update(memory)
        job["memory_config"]["precision"] = "FP32"
        path, result = work / f"{name}.json", work / f"{name}-memory.json"
        path.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, "-m", "pagedllm.bench.step_memory", str(path), str(result)],
                              capture_output=True, text=True, env=_cpu_env())
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-4000:]}")
        rows.append({"config": name, **json.loads(result.read_text())})
    rows[1]["saved_vs_cpu_offload"] = rows[0]["peak"] - rows[1]["peak"]
    return rows


def _cpu_env() -> dict:
    import os

    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # host memory is what the comparison is about


def print_results(out: dict) -> None:
    for row in out.get("fp8", []):
        diff = f"{100 * row['max_rel_loss_diff']:.2f}%" if "max_rel_loss_diff" in row else "(baseline)"
        print(f"{row['config']:<16} {row['tokens_per_s']:>9.0f} tok/s  loss {row['first_loss']:.4f} -> {row['last_loss']:.4f}"
              f"  max |loss - BF16| / BF16 {diff}")
    if out.get("fp8") and out["device"] == "cpu":
        print("  (CPU: float8 is emulated; compare the losses, not the speed)")
    for row in out.get("nvme_offload", []):
        saved = f"  saved {row['saved_vs_cpu_offload'] / MIB:.0f} MiB" if "saved_vs_cpu_offload" in row else ""
        print(f"{row['config']:<16} step peak RSS {row['peak'] / MIB:.0f} MiB (before the step {row['before'] / MIB:.0f} MiB),"
              f" optimizer states {row['state_bytes'] / MIB:.0f} MiB{saved}")
