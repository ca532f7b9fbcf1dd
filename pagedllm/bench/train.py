"""Training throughput: tokens/s and MFU (vs this machine's fp32 matmul peak) for 1 process and N ranks with ZeRO-3.

Each configuration is a real `pagedllm train` run (a subprocess; the multi-rank one through torchrun)
of a small Llama on Python standard-library text, with a tokenizer trained on the fly. Throughput is
the median over the steps after the warm-up ones, read from the run's metrics.jsonl. MFU divides the
achieved model FLOP/s (6 x parameters + attention, per token) by the fp32 matmul peak measured in this
run with every core -- the whole machine's ceiling, whatever the number of ranks (for --precision
BF16, against the bf16 matmul peak, also measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.bench.peak import measure_matmul_peak

CORPUS_FILES = ("argparse.py", "difflib.py", "textwrap.py", "inspect.py", "typing.py", "pathlib.py", "ast.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=12, help="training steps per configuration")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--ranks", type=int, default=2, help="processes of the ZeRO-3 configuration")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--precision", default="FP32", choices=["FP32", "BF16"])
    parser.add_argument("--json", type=Path, help="also write the results here")


def bench_job(args: argparse.Namespace, work: Path, name: str, zero_stage: int) -> dict:
    return {
        "job_name": f"bench-{name}",
        "log_interval_steps": 1000,
        "model_config": {"architecture": "llama", "num_layers": args.layers, "hidden_size": args.hidden,
                         "num_attention_heads": max(1, args.hidden // 64), "num_kv_heads": max(1, args.hidden // 64),
                         "intermediate_size": 3 * args.hidden, "vocab_size": 8192, "max_position_embeddings": 4096,
                         "tie_word_embeddings": True},
        "optimization_config": {"total_steps": args.steps, "warmup_steps": 2},
        "memory_config": {"zero_stage": zero_stage, "precision": args.precision},
        "data_config": {"dataset_path": str(work / "corpus"), "tokenizer_path": str(work / "tokenizer"),
                        "cache_dir": str(work / "cache"), "sequence_length": args.seq_len,
                        "global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch},
        "checkpoint_config": {"checkpoint_dir": str(work / name)},
    }


def prepare(work: Path) -> None:
    import shutil
    import sysconfig

    from pagedllm.training.tokenizer import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (work / "corpus").mkdir(parents=True)
    for name in CORPUS_FILES:
        shutil.copyfile(stdlib / name, work / "corpus" / name)
    train_tokenizer(str(work / "corpus"), 8192, work / "tokenizer")


def run_config(job: dict, work: Path, nproc: int, peak: float) -> list[dict]:
    config = work / f"{job['job_name']}.json"
    config.write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "pagedllm.training.cli", "train", "--config", str(config), "--no-export",
           "--peak-flops", str(peak / nproc)]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{job['job_name']} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    metrics = Path(job["checkpoint_config"]["checkpoint_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summarize(name: str, records: list[dict], warmup: int, flops_per_token: float, peak: float) -> dict:
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records[warmup:])
    return {"config": name, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops_per_token / peak,
            "steps_measured": len(records) - warmup}


def run(args: argparse.Namespace) -> int:
    from pagedllm.training.config import ModelConfig
    from pagedllm.training.model import flops_per_token, num_params

    peak = measure_matmul_peak()  # fp32: the denominator of MFU for FP32 runs
    compute_peak = peak if args.precision == "FP32" else measure_matmul_peak(dtype=torch.bfloat16)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-train-") as tmp:
        work = Path(tmp)
        prepare(work)
        configs = [("1 process", 1, 0), (f"{args.ranks} ranks ZeRO-3", args.ranks, 3)]
        for name, nproc, stage in configs:
            job = bench_job(args, work, name.replace(" ", "-"), stage)
            model = ModelConfig(**job["model_config"])
            fpt = flops_per_token(model, args.seq_len)
            started = time.perf_counter()
            records = run_config(job, work, nproc, compute_peak)
            result = summarize(name, records, args.warmup_steps, fpt, compute_peak)
            result["wall_s"] = time.perf_counter() - started
            results.append(result)
    params = num_params(model)
    print(f"model: llama {args.layers} layers x {args.hidden} hidden, {params / 1e6:.2f}M parameters, "
          f"seq {args.seq_len}, global batch {args.global_batch}, {args.precision}; "
          f"{fpt / 1e6:.1f} MFLOP/token")
    print(f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    if args.precision != "FP32":
        print(f"bf16 matmul peak: {compute_peak / 1e9:.1f} GFLOP/s (the MFU denominator below)")
    print(f"{'config':<20} {'tokens/s':>10} {'MFU':>7}")
    for r in results:
        print(f"{r['config']:<20} {r['tokens_per_s']:>10.0f} {100 * r['mfu']:>6.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"peak_flops": peak, "compute_peak_flops": compute_peak, "params": params,
                                         "flops_per_token": fpt, "precision": args.precision,
                                         "results": results}, indent=2))
    return 0
