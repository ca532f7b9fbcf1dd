"""What a running job tells the outside world, all from rank 0, none of it needing log scraping:

* `<checkpoint_dir>/metrics.jsonl` -- one line per step: {"step", "loss", "lr", "grad_norm",
  "tokens_per_s", "consumed_tokens"} plus "mfu", "elapsed_s" and, at evaluation steps, "val_loss".
* the events file (default `<checkpoint_dir>/events.jsonl`) -- lifecycle events, one JSON object
  per line with "event", "time" (unix seconds) and "job_id": started, step, eval, checkpoint (status
  SAVING / COMPLETE / CORRUPT / DELETED), stopping, finished (reason completed / stopped), failed.
* a tqdm bar (when stderr is a terminal) and log lines every log_interval_steps.
* `<checkpoint_dir>/loss_curve.png` at the end.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("pagedllm.training")


class JsonlWriter:
    """Append-only JSONL with one write() per record, so concurrent appenders never interleave lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


class EventLog:
    """Lifecycle events for the job service. Rank 0 writes them all, except "failed", which any rank may."""

    def __init__(self, path: Path | None, job_id: str, rank: int) -> None:
        self.writer = JsonlWriter(path) if path is not None else None
        self.job_id, self.rank = job_id, rank

    def emit(self, event: str, *, any_rank: bool = False, **fields) -> None:
        if self.writer is None or (self.rank != 0 and not any_rank):
            return
        self.writer.write({"event": event, "time": round(time.time(), 3), "job_id": self.job_id, **fields})


def truncate_after(path: Path, step: int) -> None:
    """Drop metrics of steps after `step` (left by a run that died after its last checkpoint), so a
    resumed run's metrics.jsonl holds each step once."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ProgressReporter:
    """Rank 0's metrics.jsonl, progress bar and log lines."""

    def __init__(self, checkpoint_dir: Path, total_steps: int, start_step: int, log_interval: int, enabled: bool) -> None:
        self.enabled = enabled
        self.metrics = JsonlWriter(checkpoint_dir / "metrics.jsonl") if enabled else None
        self.log_interval = log_interval
        show_bar = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not show_bar, unit="step", dynamic_ncols=True)

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        self.metrics.write(record)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        if record["step"] % self.log_interval == 0 or "val_loss" in record:
            self.info(
                f"step {record['step']} loss {record['loss']:.4f} lr {record['lr']:.3e} grad_norm {record['grad_norm']:.3f} "
                f"tokens/s {record['tokens_per_s']:.0f} mfu {100 * record['mfu']:.1f}%"
                + (f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")
            )

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if not self.bar.disable:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        self.bar.close()


def plot_loss_curve(metrics_path: Path, out: Path, title: str = "") -> Path | None:
    """Training loss per step (and validation loss where measured) as a PNG."""
    records = read_metrics(metrics_path)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", linewidth=1)
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
