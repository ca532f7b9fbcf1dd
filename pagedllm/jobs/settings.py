"""The job service's settings, and where its data lives by default."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def default_data_dir() -> Path:
    """`pagedllm serve --data-dir` default: $PAGEDLLM_DATA_DIR, else $XDG_DATA_HOME/pagedllm (~/.local/share/pagedllm)."""
    if os.environ.get("PAGEDLLM_DATA_DIR"):
        return Path(os.environ["PAGEDLLM_DATA_DIR"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "pagedllm"


DEFAULT_MAX_PENDING_JOBS = 100  # a queue a person can still read; each tick reads every PENDING job


@dataclass
class JobServiceConfig:
    data_dir: Path  # jobs.db, jobs/<id>/{job.json, events.jsonl, train.log, checkpoints/}
    slots: int  # processes jobs may run at once (GPUs, or CPU worker slots)
    cancel_grace_s: float = 10.0  # SIGTERM -> SIGKILL
    poll_interval_s: float = 0.25  # how often running jobs' events are read
    allowed_paths: tuple[Path, ...] = field(default_factory=tuple)  # besides data_dir: folders jobs may use
    cluster: str | None = None  # "ray" or "ray://HOST:PORT": place jobs on a Ray cluster (None: this node)
    max_pending_jobs: int = DEFAULT_MAX_PENDING_JOBS  # PENDING jobs at most; a submission or resume past it is a 429
    rank_failure_grace_s: float = 10.0  # after one rank failed or was lost, the others' time to report before SIGKILL
