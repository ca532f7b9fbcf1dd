"""`pagedllm bench train --expert-parallel N` / `--context-parallel N`: what EP and CP buy, per rank.

EP: a moe shape trained on N ranks with ZeRO-3, without EP (every rank gathers every expert of a
layer and runs them all on its own tokens) and with EP N (each rank keeps E/N experts; tokens move by
all-to-all). Reported: tokens/s, the expert bytes a rank gathers per MoE layer, the bytes its forward
saves for backward, and peak memory (CUDA: max allocated; CPU: peak RSS, which includes the full
model every rank builds before sharding).

CP: a llama shape at growing sequence lengths on N ranks with context parallelism N against one
process: the activation bytes a rank saves for backward (training/activation_memory.py) and tokens/s.

Each configuration is one torchrun launch of this module as a worker, which builds the real Trainer
of a real job (training/trainer.py) and times its `train_step`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

MOE = {"architecture": "moe", "num_experts": 8, "num_experts_per_token": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--expert-parallel", type=int, default=0, metavar="N",
                        help="compare EP N with no EP on N ranks, on a moe shape (instead of the ZeRO-3 comparison)")
    parser.add_argument("--context-parallel", type=int, default=0, metavar="N",
                        help="CP N vs one process at --cp-seq-lens (instead of the ZeRO-3 comparison)")
    parser.add_argument("--cp-seq-lens", default="256,512,1024", help="sequence lengths of the CP comparison")


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.expert_parallel or args.context_parallel)


def run(args: argparse.Namespace, bench_job, prepare, work: Path) -> list[dict]:
    """The EP and/or CP rows; `bench_job(args, work, name, zero_stage)` and `prepare` are bench train's."""
    prepare(work)
    rows = []
    if args.expert_parallel:
        n = args.expert_parallel
        for name, ep in ((f"moe {n} ranks, no EP", 1), (f"moe {n} ranks, EP {n}", n)):
            job = bench_job(args, work, f"ep{ep}", 3)
            job["model_config"].update(MOE, tie_word_embeddings=False)
            job["parallelism_config"] = {"expert_parallel_size": ep}
            rows.append({"config": name, "seq_len": args.seq_len, **launch(job, work, n, args)})
    if args.context_parallel:
        n = args.context_parallel
        for seq in (int(s) for s in args.cp_seq_lens.split(",")):
            for name, cp in ((f"seq {seq}, 1 process", 1), (f"seq {seq}, CP {n}", n)):
                sized = argparse.Namespace(**{**vars(args), "seq_len": seq})
                job = bench_job(sized, work, f"cp{cp}-{seq}", 0 if cp == 1 else 3)
                job["parallelism_config"] = {"context_parallel_size": cp}
                rows.append({"config": name, "seq_len": seq, **launch(job, work, cp, args)})
    return rows


def launch(job: dict, work: Path, nproc: int, args: argparse.Namespace) -> dict:
    spec = work / f"{job['job_name']}-spec.json"
    spec.write_text(json.dumps({"job": job, "steps": args.steps, "warmup": args.warmup_steps, "out": str(work)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pagedllm.bench.train_parallel", str(spec)]
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{job['job_name']} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    ranks = [json.loads((work / f"{job['job_name']}-rank{r}.json").read_text()) for r in range(nproc)]
    return {"tokens_per_s": ranks[0]["tokens_per_s"], "ranks": nproc,
            **{key: max(r[key] for r in ranks) for key in ("activation_bytes", "expert_bytes_gathered", "peak_bytes")}}


def print_rows(rows: list[dict]) -> None:
    print(f"{'config':<28} {'tokens/s':>9} {'saved activations/rank':>23} {'experts gathered/layer':>23} {'peak/rank':>10}")
    for r in rows:
        experts = f"{r['expert_bytes_gathered'] / 2**20:>20.2f} MiB" if r["expert_bytes_gathered"] else f"{'-':>24}"
        print(f"{r['config']:<28} {r['tokens_per_s']:>9.0f} {r['activation_bytes'] / 2**20:>20.2f} MiB "
              f"{experts} {r['peak_bytes'] / 2**20:>6.0f} MiB")


# ---- the worker (one per rank, under torchrun) ----------------------------------------------------

def _expert_bytes_gathered(trainer) -> int:
    """Bytes of the experts one MoE layer computes with on this rank: all E without EP, E/ep with it."""
    from pagedllm.training.expert_parallel import moe_blocks

    blocks = moe_blocks(trainer.parts[0])
    if not blocks:
        return 0
    # a DTensor's numel is its whole tensor's: what FSDP gathers for the layer's forward
    return sum(p.numel() * p.element_size() for p in blocks[0].experts.parameters())


def worker(spec_path: str) -> None:
    import torch.distributed as dist

    from pagedllm.training.activation_memory import saved_activation_bytes
    from pagedllm.training.config import parse_job
    from pagedllm.training.optim import lr_at, set_lr
    from pagedllm.training.trainer import RunOptions, Trainer, init_distributed

    spec = json.loads(Path(spec_path).read_text())
    init_distributed()
    trainer = Trainer(parse_job(spec["job"]), RunOptions(peak_flops=1e12, export_hf=False))
    inputs = trainer._local_sequence(trainer.data.step_batch(1)[0].to(trainer.device))
    part = trainer.parts[0]
    activations = saved_activation_bytes(part, lambda: part(inputs[: trainer.job.data.micro_batch_size]))
    times = []
    for step in range(1, spec["steps"] + 1):
        set_lr(trainer.optimizers, lr_at(step, trainer.job.optimization))
        dist.barrier()
        started = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - started)
    measured = sorted(times[spec["warmup"]:])
    seconds = measured[len(measured) // 2]
    if trainer.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"tokens_per_s": trainer.tokens_per_step / seconds, "activation_bytes": activations,
              "expert_bytes_gathered": _expert_bytes_gathered(trainer), "peak_bytes": peak}
    (Path(spec["out"]) / f"{spec['job']['job_name']}-rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])
