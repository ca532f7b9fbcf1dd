"""One training rank: what `pagedllm train` runs in-process, and what torchrun starts N times.

    python -m torch.distributed.run --nproc-per-node N ... -m pagedllm.training.worker --config job.json

Exit codes: 0 completed (or stopped by the stop file / --stop-at-step), 128 + signal number when
stopped by SIGTERM/SIGINT (after the checkpoint), 1 on failure (a "failed" event names the reason),
2 for an invalid config.
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from pagedllm.training.config import ConfigError, load_job
from pagedllm.training.progress import EventLog
from pagedllm.training.run_options import RunOptions, add_run_arguments, options_from
from pagedllm.training.trainer import EXIT_CONFIG_ERROR, run_training


def run_worker(config: Path, options: RunOptions) -> int:
    """Run one rank to the end; failures become a "failed" event (from whichever rank hit it)."""
    try:
        job = load_job(config)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        return run_training(job, options).exit_code
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except BaseException as exc:
        _report_failure(job, options, exc)
        raise


def _report_failure(job, options: RunOptions, exc: BaseException) -> None:
    import os

    rank = int(os.environ.get("RANK", 0))
    events = EventLog(options.events_file or job.checkpoint_dir / "events.jsonl", str(job.job_id), rank)
    reason = f"{type(exc).__name__}: {exc}"
    events.emit("failed", any_rank=True, rank=rank, reason=reason, traceback=traceback.format_exc(limit=8))


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("matplotlib", "PIL", "torch.distributed.checkpoint"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one pagedllm training rank (started by torchrun)")
    parser.add_argument("--config", type=Path, required=True)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    return run_worker(args.config, options_from(args))


if __name__ == "__main__":
    sys.exit(main())
