"""`pagedllm finetune`: fine-tune a served model on a chat JSONL in one command.

    pagedllm finetune --model @default --data chat.jsonl --method lora --out my-adapter

It is a TrainingJob with a finetune_config section (what a job file or the job API would say),
run in this process like `pagedllm train`: checkpoints, resume and metrics live in
DIR/checkpoints, and the result is copied to DIR itself -- a PEFT adapter folder (lora, qlora) or a
Hugging Face model folder (full), ready for `pagedllm serve` (after `pagedllm export --merge` for an
adapter).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from pagedllm.training.config import DEFAULT_BASE_MODEL, ConfigError, FinetuneMethod, TrainingJob, parse_job

DEFAULT_LEARNING_RATE = {"full": 2e-5, "lora": 2e-4, "qlora": 2e-4}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a model (HF folder, .gguf or @default) on chat JSONL: full, LoRA or QLoRA")
    p.add_argument("--model", default=DEFAULT_BASE_MODEL, help="a Hugging Face folder, a .gguf file, or @default (SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, help="JSONL: {'messages': [...]} or {'prompt': ..., 'completion': ...} per line")
    p.add_argument("--method", choices=[m.value for m in FinetuneMethod], default="lora", help="full weights, LoRA, or LoRA over the kept 4-bit blocks (default: %(default)s)")
    p.add_argument("--out", required=True, type=Path, help="where the adapter (lora, qlora) or model folder (full) goes")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: %(default)s)")
    p.add_argument("--learning-rate", type=float, help="default 2e-4 for lora/qlora, 2e-5 for full")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r (default: %(default)s)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha: the update is scaled by alpha / r (default: %(default)s)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapter's input (default: %(default)s)")
    p.add_argument("--target-modules", default=None, help="comma-separated, default all seven projections")
    p.add_argument("--max-seq-len", type=int, default=512, help="rows of packed examples are this long")
    p.add_argument("--batch-size", type=int, default=8, help="rows per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per forward pass; batch-size / micro-batch-size accumulate (default: %(default)s)")
    p.add_argument("--validation-split", type=float, default=0.0, help="share of examples held out for the eval loss (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the order and the adapter's initialisation (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoints' newest checkpoint")
    p.add_argument("--peak-flops", type=float, help="per-process FLOP/s for MFU (default: measured)")
    p.set_defaults(func=run_finetune)


def finetune_job(args: argparse.Namespace) -> TrainingJob:
    """The TrainingJob the flags describe (ConfigError naming the field on a bad value)."""
    finetune = {"base_model": args.model, "method": args.method, "lora_rank": args.lora_rank,
                "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout}
    if args.target_modules:
        finetune["target_modules"] = [m.strip() for m in args.target_modules.split(",") if m.strip()]
    lr = args.learning_rate if args.learning_rate is not None else DEFAULT_LEARNING_RATE[args.method]
    return parse_job({
        "job_name": f"finetune-{args.out.name}",
        "seed": args.seed,
        "finetune_config": finetune,
        "data_config": {"dataset_path": str(Path(args.data).resolve()), "sequence_length": args.max_seq_len,
                        "global_batch_size": args.batch_size, "micro_batch_size": min(args.micro_batch_size, args.batch_size),
                        "validation_split": args.validation_split},
        "optimization_config": {"total_steps": args.steps, "learning_rate": lr, "warmup_steps": min(10, args.steps // 10),
                                "weight_decay": 0.0 if args.method != "full" else 0.1, "lr_scheduler": "COSINE"},
        "memory_config": {"zero_stage": 0},
        "checkpoint_config": {"checkpoint_dir": str(args.out / "checkpoints")},
        "log_interval_steps": max(1, min(10, args.steps // 10)),
    })


def publish(checkpoint_dir: Path, out: Path, adapter: bool) -> Path:
    """Copy the run's result (adapter-final or hf-final) into `out` itself."""
    source = checkpoint_dir / ("adapter-final" if adapter else "hf-final")
    for file in source.iterdir():
        shutil.copy2(file, out / file.name)
    return out


def run_finetune(args: argparse.Namespace) -> int:
    from pagedllm.training.checks import check_job
    from pagedllm.training.provenance import continue_job
    from pagedllm.training.run_options import RunOptions
    from pagedllm.training.trainer import EXIT_COMPLETED, EXIT_CONFIG_ERROR, run_training

    try:
        job = continue_job(check_job(finetune_job(args), 1))
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if (args.out / "checkpoints").is_dir() and not args.resume and any((args.out / "checkpoints").glob("step-*")):
        print(f"{args.out}/checkpoints already holds checkpoints: pass --resume to continue, or pick another --out",
              file=sys.stderr)
        return EXIT_CONFIG_ERROR
    job.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    result = run_training(job, RunOptions(peak_flops=args.peak_flops))
    if result.exit_code == EXIT_COMPLETED and result.reason == "completed":
        out = publish(job.checkpoint_dir, args.out, job.finetune.adapter)
        kind = "PEFT adapter" if job.finetune.adapter else "Hugging Face model"
        print(f"wrote {kind} folder {out}" + (f" (val loss {result.val_loss:.4f})" if result.val_loss is not None else ""))
    return result.exit_code
