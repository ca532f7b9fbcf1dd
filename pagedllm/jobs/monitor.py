"""Follows a running job's structured channel into the store.

The channel is the trainer's events file (`--events-file`, one JSON object per line, see
pagedllm/training/progress.py): "started" (ranks, pids, start step), "step" (the metrics),
"checkpoint" (SAVING / COMPLETE / CORRUPT / DELETED, with the folder of its manifest), "failed"
(any rank's exception), "finished" (completed or stopped, exit code). Checkpoint records are taken
from the manifests themselves (the platform's Checkpoint record, with shard sizes and checksums). No log line
is parsed.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pydantic import ValidationError

from pagedllm.jobs.records import JobRecord, JobState, RunRecord, Transition
from pagedllm.jobs.store import JobStore
from pagedllm.training.checkpoint import CheckpointStatus, authentic, list_checkpoints

log = logging.getLogger("pagedllm.jobs")

METRIC_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_tokens", "mfu", "elapsed_s", "val_loss")


class EventFollower:
    """New complete lines of a JSONL file, from a byte offset on (a line still being written waits)."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.offset = path, offset

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        events = []
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                log.warning("%s: skipping a line that is not JSON: %r", self.path, line[:200])
                continue
            if isinstance(event, dict):
                events.append(event)
        return events


def change_status(job: JobRecord, status: JobState, reason: str | None = None) -> Transition:
    """Move the record to `status` (the caller saves it with the returned transition)."""
    now = time.time()
    job.status, job.updated_at = status, now
    if status.terminal:
        job.finished_at = now
    return Transition(status, now, reason)


class JobMonitor:
    """Applies one run's events to the job's record, metrics, run and checkpoint records."""

    def __init__(self, store: JobStore, job: JobRecord, run: RunRecord, events_path: Path, key: bytes) -> None:
        """`key`: the service's checkpoint key; only manifests signed with it are recorded."""
        self.store, self.job, self.run, self.key = store, job, run, key
        self.follower = EventFollower(events_path, job.events_offset)

    def poll(self) -> None:
        """Read and apply what the job wrote since the last poll."""
        events = self.follower.read()
        if not events:
            return
        steps: list[dict] = []
        transitions: list[Transition] = []
        for event in events:
            kind = event.get("event")
            if kind == "step":
                steps.append({k: event[k] for k in METRIC_KEYS if k in event})
            elif kind == "started":
                transitions += self._started(event)
            elif kind == "checkpoint":
                transitions += self._checkpoint(event)
            elif kind == "failed":
                self.job.failures.append({k: event.get(k) for k in ("rank", "reason", "time")})
            elif kind == "finished":
                self.job.finish = {k: event.get(k) for k in ("reason", "step", "exit_code", "time")}
        if steps:
            self.store.add_metrics(self.job.job_id, self.job.run, steps)
        self.job.events_offset = self.follower.offset
        self.job.updated_at = time.time()
        self.store.save(self.job, transitions)

    def _started(self, event: dict) -> list[Transition]:
        self.job.processes = [{"rank": p.get("rank"), "pid": p.get("pid"), "host": p.get("host")}
                              for p in event.get("processes") or []]
        self.run.start_step = event.get("step")
        self.run.resumed_from = event.get("resumed_from") or self.run.resumed_from
        self.store.save_run(self.job.job_id, self.run)
        if not self.run.resumed_from or self.run.start_step is None:
            return []
        # the steps after the checkpoint are trained again: the dead run's records of them go
        self.store.drop_metrics_after(self.job.job_id, self.run.start_step)
        return [Transition(self.job.status, time.time(),
                           f"run {self.run.run} resumed from checkpoint {self.run.resumed_from} at step {self.run.start_step}")]

    def _checkpoint(self, event: dict) -> list[Transition]:
        sync_checkpoints(self.store, self.job, self.key)
        status, checkpoint_id = event.get("status"), event.get("checkpoint_id")
        if status == CheckpointStatus.SAVING.value and self.job.status is JobState.RUNNING:
            return [change_status(self.job, JobState.CHECKPOINTING, f"saving checkpoint {checkpoint_id} at step {event.get('step')}")]
        notes = []
        if status == CheckpointStatus.CORRUPT.value:
            what = ("could not be saved" if event.get("during") == "save"
                    else "failed verification (an older COMPLETE checkpoint is used)")
            notes.append(Transition(self.job.status, time.time(), f"checkpoint {checkpoint_id} (step {event.get('step')}) "
                                                                  f"{what} and is marked CORRUPT: {event.get('reason')}"))
        if status in (CheckpointStatus.COMPLETE.value, CheckpointStatus.CORRUPT.value):
            if checkpoint_id == self.job.requested_checkpoint_id:
                self.job.requested_checkpoint_id = None
            if self.job.status is JobState.CHECKPOINTING and self.job.requested_checkpoint_id is None:
                return [*notes, change_status(self.job, JobState.RUNNING, f"checkpoint {checkpoint_id} {status.lower()}")]
        return notes


def sync_checkpoints(store: JobStore, job: JobRecord, key: bytes) -> None:
    """Copy every manifest of the job's checkpoint_dir into the store (they change: SAVING ->
    COMPLETE -> DELETED when pruned): those the job wrote, signed with the service's `key`, not
    whatever else lies there claiming the job's id."""
    try:
        found = list_checkpoints(job.checkpoint_dir, skip_unreadable=True)
    except (OSError, ValidationError, ValueError) as exc:  # a manifest replaced while we read: next time
        log.debug("checkpoint scan of %s: %s", job.checkpoint_dir, exc)
        return
    for step_dir, manifest in found:
        if str(manifest.job_id) == job.job_id and authentic(manifest, key):
            record = manifest.model_dump(mode="json", exclude={"signature", "rng_states"})
            store.put_checkpoint(job.job_id, {**record, "path": str(step_dir)})


def abandon_unfinished_saves(store: JobStore, job: JobRecord) -> None:
    """A job that ended mid-save leaves a SAVING manifest: record it as CORRUPT (never resumable)."""
    for record in store.checkpoints(job.job_id):
        if record["status"] == CheckpointStatus.SAVING.value:
            record.update(status=CheckpointStatus.CORRUPT.value, status_reason="the job ended before this save completed")
            store.put_checkpoint(job.job_id, record)


def outcome(job: JobRecord, exit_code: int | None, last_log_line: str | None,
            ended: str | None = None) -> tuple[JobState, str | None]:
    """The state a run ended in, from its events, the launcher's exit code and whether it was cancelled.
    `ended` says how the run ended where there is no launcher (a Ray run: its nodes and ranks)."""
    finish = job.finish or {}
    if finish.get("reason") == "completed":  # written after the final checkpoint and the last barrier
        if exit_code:
            return JobState.COMPLETED, (f"completed at step {finish.get('step')}, then {'a rank' if ended else 'the launcher'} exited with code "
                                        f"{exit_code}: a rank failed while shutting down, after the final checkpoint")
        return JobState.COMPLETED, None
    if job.cancel_requested:
        at = f" at step {finish['step']}" if finish.get("step") is not None else ""
        return JobState.CANCELLED, f"cancelled by request{at}"
    if finish.get("reason") == "stopped" and not job.failures:
        signal = (finish.get("exit_code") or 128) - 128
        by = f"signal {signal}" if signal > 0 else "a stop request"
        return JobState.CANCELLED, f"stopped from outside the job service ({by}) at step {finish.get('step')}"
    return JobState.FAILED, failure_reason(job, exit_code, last_log_line, ended)


def failure_reason(job: JobRecord, exit_code: int | None, last_log_line: str | None, ended: str | None = None) -> str:
    if ended is not None:
        parts = [ended]
    elif exit_code is None:
        parts = ["the job's processes ended while the server was not watching them (exit code unknown)"]
    elif exit_code < 0:
        parts = [f"the launcher was killed by signal {-exit_code}"]
    else:
        parts = [f"the launcher exited with code {exit_code}"]
    reported = {f.get("rank") for f in job.failures}
    for failure in job.failures[:3]:
        parts.append(f"rank {failure.get('rank')}: {failure.get('reason')}")
    silent = [p for p in job.processes if p.get("rank") not in reported]
    if job.failures and silent and len(silent) < len(job.processes):
        parts.append("ranks without a report (killed?): " + ", ".join(f"{p['rank']} (pid {p['pid']})" for p in silent))
    if not job.failures:
        parts.append("no rank reported an error (was a process killed?)")
        if last_log_line:
            parts.append(f"last log line: {last_log_line}")
    return "; ".join(parts)
