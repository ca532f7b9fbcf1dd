"""Training throughput: tokens/s and MFU (vs the device's measured matmul peak) for 1 process and N ranks with ZeRO-3.

Each configuration is a real `pagedllm train` run (a subprocess; the multi-rank one through torchrun)
of a small Llama on Python standard-library text, with a tokenizer trained on the fly. Throughput is
the median over the steps after the warm-up ones, read from the run's metrics.jsonl. MFU divides the
achieved model FLOP/s (6 x parameters + attention, per token) by the matmul peak measured in this
run on the training device in the compute dtype (fp32, or bf16 for --precision BF16). On CPU that
is every core together -- the whole machine's ceiling, whatever the number of ranks; on CUDA each
rank has its own GPU, so the peak is per GPU times the ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.matmul_peak import measure_matmul_peak

CORPUS_FILES = ("argparse.py", "difflib.py", "textwrap.py", "inspect.py", "typing.py", "pathlib.py", "ast.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=12, help="training steps per configuration")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--ranks", type=int, default=2, help="processes of the ZeRO-3 configuration")
    parser.add_argument("--layers", type=int, default=6, help='transformer layers of the benchmarked model (default: %(default)s)')
    parser.add_argument("--hidden", type=int, default=256, help='hidden size (default: %(default)s)')
    parser.add_argument("--seq-len", type=int, default=256, help='tokens per sequence (default: %(default)s)')
    parser.add_argument("--global-batch", type=int, default=16, help='sequences per optimizer step (default: %(default)s)')
    parser.add_argument("--micro-batch", type=int, default=8, help='sequences per forward/backward (default: %(default)s)')
    parser.add_argument("--precision", default="FP32", choices=["FP32", "BF16"], help='training precision (default: %(default)s)')
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the runs train (auto: CUDA when available); the peak is measured there")
    from pagedllm.bench import train_precision

    train_precision.add_arguments(parser)  # --fp8, --nvme-offload (bench/train_precision.py)
    parser.add_argument("--json", type=Path, help="also write the results here")
    from pagedllm.bench import train_parallel

    train_parallel.add_arguments(parser)


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


def run_config(job: dict, work: Path, nproc: int, per_rank_peak: float, device: str) -> list[dict]:
    config = work / f"{job['job_name']}.json"
    config.write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "pagedllm.training.cli", "train", "--config", str(config), "--no-export",
           "--peak-flops", str(per_rank_peak)]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer takes a GPU whenever it sees one
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{job['job_name']} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    metrics = Path(job["checkpoint_config"]["checkpoint_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summarize(name: str, records: list[dict], warmup: int, flops_per_token: float, peak: float) -> dict:
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records[warmup:])
    return {"config": name, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops_per_token / peak,
            "steps_measured": len(records) - warmup}


def run(args: argparse.Namespace) -> int:
    from pagedllm.bench import train_precision

    if train_precision.wanted(args):  # FP8 vs BF16, NVMe offload vs cpu_offload
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        with tempfile.TemporaryDirectory(prefix="pagedllm-bench-train-") as tmp:
            out = train_precision.run(args, bench_job, prepare, run_config, Path(tmp), device)
        train_precision.print_results(out)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return 0
    from pagedllm.training.config import ModelShapeConfig
    from pagedllm.training.model import flops_per_token, num_params

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    from pagedllm.bench import train_parallel

    if train_parallel.wanted(args):  # EP / CP comparisons (bench/train_parallel.py)
        with tempfile.TemporaryDirectory(prefix="pagedllm-bench-train-") as tmp:
            rows = train_parallel.run(argparse.Namespace(**{**vars(args), "device": device}), bench_job, prepare, Path(tmp))
        train_parallel.print_rows(rows)
        if args.json:
            args.json.write_text(json.dumps({"device": device, "results": rows}, indent=2))
        return 0
    ranks = _ranks_for(device, args.ranks)
    dtype = torch.float32 if args.precision == "FP32" else torch.bfloat16
    peak = measure_matmul_peak(dtype=dtype, device=device)  # one device: all CPU cores, or one GPU
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-train-") as tmp:
        work = Path(tmp)
        prepare(work)
        configs = [("1 process", 1, 0), (f"{ranks} ranks ZeRO-3", ranks, 3)] if ranks > 1 else [("1 process", 1, 0)]
        for name, nproc, stage in configs:
            job = bench_job(args, work, name.replace(" ", "-"), stage)
            model = ModelShapeConfig(**job["model_config"])
            fpt = flops_per_token(model, args.seq_len)
            # CPU ranks share the cores measured together; each CUDA rank has a GPU of its own.
            per_rank, total = (peak / nproc, peak) if device == "cpu" else (peak, peak * nproc)
            started = time.perf_counter()
            records = run_config(job, work, nproc, per_rank, device)
            result = summarize(name, records, args.warmup_steps, fpt, total)
            result["wall_s"] = time.perf_counter() - started
            results.append(result)
    params = num_params(model)
    print(f"model: llama {args.layers} layers x {args.hidden} hidden, {params / 1e6:.2f}M parameters, "
          f"seq {args.seq_len}, global batch {args.global_batch}, {args.precision}; "
          f"{fpt / 1e6:.1f} MFLOP/token")
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.precision.lower()} matmul peak on {where}: {peak / 1e9:.1f} GFLOP/s (the MFU denominator below)")
    print(f"{'config':<20} {'tokens/s':>10} {'MFU':>7}")
    for r in results:
        print(f"{r['config']:<20} {r['tokens_per_s']:>10.0f} {100 * r['mfu']:>6.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "peak_flops": peak, "params": params,
                                         "flops_per_token": fpt, "precision": args.precision,
                                         "results": results}, indent=2))
    return 0


def _ranks_for(device: str, ranks: int) -> int:
    """On CUDA each rank needs a GPU of its own."""
    if device == "cpu":
        return ranks
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    available = torch.cuda.device_count()
    if ranks > available:
        print(f"only {available} GPU(s): the ZeRO-3 configuration runs on {available} rank(s)")
    return min(ranks, available)
