"""`pagedllm train`, `pagedllm export`, `pagedllm tokenizer train` and `pagedllm distill`.

`train` validates the job for the world size it is about to launch (nnodes x nproc-per-node) before
any process starts, writes the job (with its job_id fixed) to <checkpoint_dir>/job.json, then either
runs one rank in this process or replaces itself with torchrun (`python -m torch.distributed.run`),
so the pid a supervisor started is torchrun's and its signals reach the workers through torchrun.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pagedllm.training.config import ConfigError, TrainingJob, apply_overrides, load_job
from pagedllm.training.checks import check_job  # noqa: F401  (also what the job service calls)
from pagedllm.training.provenance import continue_job
from pagedllm.training.run_options import add_run_arguments


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train a model from a TrainingJob config (TOML or JSON)")
    train.add_argument("--config", type=Path, required=True, help="job.toml or job.json (a TrainingJob: training/config.py)")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       help="override a config field, e.g. --set optimization_config.total_steps=100")
    train.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (>1 launches torchrun)")
    train.add_argument("--nnodes", type=int, default=1, help="machines taking part (torchrun --nnodes)")
    train.add_argument("--node-rank", type=int, help="this machine's rank (static rendezvous only)")
    train.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous (torchrun --rdzv-endpoint)")
    train.add_argument("--rdzv-id", help="rendezvous id shared by all nodes (default: the job_id)")
    add_run_arguments(train)
    train.set_defaults(func=run_train)

    export = subparsers.add_parser("export", help="write a Hugging Face model folder from a checkpoint, or merge a LoRA adapter")
    export.add_argument("--checkpoint", help="a checkpoint folder (step-NNNNNNNN) or a checkpoint_dir")
    export.add_argument("--adapter", type=Path, help="a PEFT LoRA adapter folder (with --merge)")
    export.add_argument("--merge", action="store_true", help="merge --adapter into its base model")
    export.add_argument("--base", help="the adapter's base model (default: its adapter_config.json's base_model_name_or_path)")
    export.add_argument("--out", required=True, type=Path, help="the Hugging Face folder to write")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the exported weights' type (default: %(default)s)")
    export.set_defaults(func=run_export)

    tokenizer = subparsers.add_parser("tokenizer", help="tokenizer tools")
    tok_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train", help="train a byte-level BPE tokenizer on a corpus")
    tok_train.add_argument("--input", required=True, help="text file, folder, JSONL with 'text', or @stdlib")
    tok_train.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, special tokens included")
    tok_train.add_argument("--out", required=True, type=Path, help="folder to write the tokenizer files to")
    tok_train.add_argument("--glob", default="**/*", help="files taken from an input folder (e.g. '**/*.py')")
    tok_train.add_argument("--min-frequency", type=int, default=2, help="merges seen fewer times are not learned (default: %(default)s)")
    tok_train.set_defaults(func=run_tokenizer_train)

    from pagedllm.training import distill  # a draft model's corpus: its target's continuations
    from pagedllm.training import finetune_cli

    distill.register(subparsers)
    finetune_cli.register(subparsers)


def prepare_job(args: argparse.Namespace) -> TrainingJob:
    """Load, override and validate the job for nnodes x nproc-per-node processes; ConfigError otherwise."""
    job = apply_overrides(load_job(args.config), args.set)
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ConfigError("--nproc-per-node", "needs --nproc-per-node >= 1 and --nnodes >= 1")
    return continue_job(check_job(job, args.nproc_per_node * args.nnodes))


def run_train(args: argparse.Namespace) -> int:
    from pagedllm.training.trainer import EXIT_CONFIG_ERROR

    try:
        job = prepare_job(args)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    job.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    config_path = job.checkpoint_dir / "job.json"
    config_path.write_text(job.model_dump_json(indent=2))
    worker_args = _worker_arguments(args)
    if args.nproc_per_node == 1 and args.nnodes == 1:
        from pagedllm.training.worker import main as worker_main  # the worker imports nothing of this module

        return worker_main(["--config", str(config_path), *worker_args])
    command = torchrun_command(args, job, config_path, worker_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
    return 1  # not reached


def _worker_arguments(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, value in (("--resume-from", args.resume_from), ("--events-file", args.events_file),
                        ("--stop-at-step", args.stop_at_step), ("--peak-flops", args.peak_flops)):
        if value is not None:
            out += [flag, str(value)]
    return out + (["--no-export"] if args.no_export else [])


def torchrun_command(args: argparse.Namespace, job: TrainingJob, config_path: Path, worker_args: list[str]) -> list[str]:
    """argv for `python -m torch.distributed.run ... -m pagedllm.training.worker ...`."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}"]
    if args.nnodes == 1 and not args.rdzv_endpoint:
        command.append("--standalone")  # a free local port: several jobs can run side by side
    else:
        command += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-id={args.rdzv_id or job.job_id}"]
        if args.rdzv_endpoint:
            command.append(f"--rdzv-endpoint={args.rdzv_endpoint}")
        if args.node_rank is not None:
            command.append(f"--node-rank={args.node_rank}")
    return command + ["-m", "pagedllm.training.worker", "--config", str(config_path), *worker_args]


def run_export(args: argparse.Namespace) -> int:
    from pagedllm.adapters.peft_format import AdapterFormatError
    from pagedllm.load_errors import ModelLoadError
    from pagedllm.training.export import export_checkpoint, merge_adapter

    if bool(args.checkpoint) == bool(args.adapter) or bool(args.adapter) != args.merge:
        print("export: give --checkpoint, or --adapter DIR --merge", file=sys.stderr)
        return 2
    try:
        if args.adapter:
            out = merge_adapter(args.adapter, args.out, args.base, args.dtype)
        else:
            out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    except (AdapterFormatError, ConfigError, ModelLoadError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def run_tokenizer_train(args: argparse.Namespace) -> int:
    from pagedllm.training.tokenizer import train_tokenizer

    try:
        path = train_tokenizer(args.input, args.vocab_size, args.out, args.glob, args.min_frequency)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenizer train: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {path.parent / 'tokenizer_config.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The training commands alone: `python -m pagedllm.training.cli train ...` (what tests run)."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm training commands")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
