"""How one training run is started, apart from its job: where it resumes, where its events go,
when it stops early. `pagedllm train` (cli.py) takes them as flags and hands them on to the
worker it launches (worker.py), which parses the same flags; a light module, so the CLI can
register them without importing the trainer."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunOptions:
    resume_from: str | None = None
    events_file: Path | None = None  # default <checkpoint_dir>/events.jsonl
    stop_at_step: int | None = None  # stop (and checkpoint) at this step, as if asked to
    export_hf: bool = True  # write <checkpoint_dir>/hf-final when training completes
    peak_flops: float | None = None  # per process; measured at start when None


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `pagedllm train` (training/cli.py) and the worker it launches."""
    parser.add_argument("--resume-from", help="checkpoint folder, checkpoint_id or step-NNNNNNNN name "
                        "(default: newest COMPLETE checkpoint in checkpoint_dir, if any)")
    parser.add_argument("--events-file", type=Path, help="lifecycle events JSONL (default <checkpoint_dir>/events.jsonl)")
    parser.add_argument("--stop-at-step", type=int, help="stop (saving a checkpoint) after this step")
    parser.add_argument("--no-export", action="store_true", help="skip the hf-final export at the end")
    parser.add_argument("--peak-flops", type=float, help="per-process FLOP/s for MFU (default: measured)")


def options_from(args: argparse.Namespace) -> RunOptions:
    return RunOptions(resume_from=args.resume_from, events_file=args.events_file, stop_at_step=args.stop_at_step,
                      export_hf=not args.no_export, peak_flops=args.peak_flops)
