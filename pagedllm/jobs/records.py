"""What the job store holds: one JobRecord per job, its state changes and its runs (launches).

Plain dataclasses, so a store can map them to rows without knowing the API's pydantic views. Times
are unix seconds (floats); the API turns them into ISO 8601.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.training.config import JobStatus

# The job service's name for the training side's status enum: one set of states for both.
JobState = JobStatus


RESUMABLE = (JobState.FAILED, JobState.CANCELLED)


@dataclass
class JobRecord:
    job_id: str
    job_name: str
    status: JobState
    config: dict  # the TrainingJob as submitted (by alias), job_id and checkpoint_dir filled in
    world_size: int
    queue_seq: int  # position in the PENDING queue; renewed when a job is resumed
    created_at: float
    updated_at: float
    started_at: float | None = None  # of the current run
    finished_at: float | None = None
    failure_reason: str | None = None
    run: int = 0  # launches so far
    pid: int | None = None  # the launcher (torchrun, or the only rank) of the current run
    pid_create_time: float | None = None  # with pid: the process's identity (pids are reused)
    events_offset: int = 0  # bytes of the events file already applied
    cancel_requested: bool = False
    requested_checkpoint_id: str | None = None  # asked for, not yet COMPLETE
    resume_from: str | None = None  # checkpoint_id the caller named for the current run (None: newest intact)
    exit_code: int | None = None
    processes: list[dict] = field(default_factory=list)  # the ranks: {"rank", "pid", "host"}
    failures: list[dict] = field(default_factory=list)  # "failed" events of the current run
    finish: dict | None = None  # the "finished" event of the current run

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.config["checkpoint_config"]["checkpoint_dir"])

    @property
    def total_steps(self) -> int | None:
        return self.config.get("optimization_config", {}).get("total_steps")


@dataclass
class Transition:
    status: JobState
    at: float
    reason: str | None = None


@dataclass
class RunRecord:
    """One launch of a job: the first run, then one per resume."""

    run: int
    started_at: float
    resumed_from: str | None = None
    start_step: int | None = None  # from the trainer's "started" event
    ended_at: float | None = None
    exit_code: int | None = None
    outcome: str | None = None  # the job state this run ended in
