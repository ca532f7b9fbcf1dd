"""The job service: the component `create_app` runs (async start/stop) behind /v1/training and /v1/cluster.

One asyncio task ticks every `poll_interval_s`: each running job's events go into the store, a
cancel past its grace period escalates to SIGKILL, a job whose launcher has exited is finalised once
no process of it is left, and PENDING jobs start in queue order while slots are free.

On start the service reconciles: every job the store thought RUNNING or CHECKPOINTING is looked up
by pid *and* start time. Alive, it is followed again from the events it had not yet read; gone, its
remaining events are read and it ends as the events say (COMPLETED if it finished meanwhile, else
FAILED with the reason). Running jobs outlive a server stop: they are in sessions of their own.

One server owns a data dir at a time (an flock); a second one answers 503 on these routes.
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.jobs.cluster import ClusterMonitor, default_slots
from pagedllm.jobs.confinement import AllowedRoots, check_confined
from pagedllm.jobs.launcher import JobPaths, LaunchSpec, ProcessRef, kill_all, signal_launcher, spawn, train_command
from pagedllm.jobs.monitor import JobMonitor, abandon_unfinished_saves, change_status, outcome, sync_checkpoints
from pagedllm.jobs.records import RESUMABLE, JobRecord, JobState, RunRecord, Transition
from pagedllm.jobs.slots import startable, used_slots
from pagedllm.jobs.settings import JobServiceConfig
from pagedllm.jobs.store import JobStore, SQLiteJobStore
from pagedllm.jobs.submission import build_config, check_checkpoint_dir, check_runnable
from pagedllm.training.checkpoint import CheckpointStatus
from pagedllm.training.config import ConfigError
from pagedllm.training.control import CHECKPOINT_REQUEST, STOP_REQUEST

log = logging.getLogger("pagedllm.jobs")


class JobNotFound(LookupError):
    def __init__(self, what: str, param: str = "job_id") -> None:
        super().__init__(what)
        self.param = param


class WrongState(RuntimeError):
    """The job is not in a state that allows the request (HTTP 409)."""


class Unavailable(RuntimeError):
    """The service cannot serve (no data dir, or another server owns it)."""


@dataclass
class Active:
    """A job that has (or may still have) processes, and what follows it."""

    job: JobRecord
    launcher: ProcessRef
    monitor: JobMonitor
    popen: subprocess.Popen | None = None  # None after a restart: we are no longer the parent
    kill_at: float | None = None  # monotonic time after which what is left gets SIGKILL
    exit_code: int | None = None
    launcher_ended: bool = False


class JobService:
    def __init__(self, config: JobServiceConfig | None, unavailable: str | None = None) -> None:
        self.config = config
        self.unavailable = unavailable  # why the routes answer 503, if they do
        self.roots = AllowedRoots(config.data_dir, config.allowed_paths) if config is not None else None
        self.store: JobStore | None = None
        self.cluster: ClusterMonitor | None = None
        self.active: dict[str, Active] = {}  # job_id -> the job's processes and monitor
        self._task: asyncio.Task | None = None
        self._lock_fd: int | None = None

    @classmethod
    def from_settings(cls, data_dir: str | None, slots: int | None, allowed_paths: list[str] | tuple[str, ...] = ()) -> JobService:
        if data_dir is None:
            return cls(None, unavailable="the training job service needs a data dir (pagedllm serve --data-dir DIR)")
        return cls(JobServiceConfig(Path(data_dir).expanduser().resolve(), slots or default_slots(),
                                    allowed_paths=tuple(Path(p) for p in allowed_paths)))

    # ---- lifecycle ----

    async def start(self) -> None:
        if self.open():
            self._task = asyncio.create_task(self._loop(), name="pagedllm-jobs")

    def open(self) -> bool:
        """Own the data dir, open the store, reconcile; False if the service cannot serve."""
        if self.config is None or not self._acquire_data_dir():
            return False
        self.store = SQLiteJobStore(self.config.data_dir / "jobs.db")
        self.cluster = ClusterMonitor(self.config.slots)
        self.reconcile()
        return True

    async def stop(self) -> None:
        """Stop following jobs (they keep running; the next server re-attaches) and release the data dir."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.close()

    def close(self) -> None:
        self.active.clear()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _acquire_data_dir(self) -> bool:
        """Take the data dir's lock; without it, answer 503 rather than run jobs twice."""
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        path = self.config.data_dir / "service.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            self.unavailable = f"the data dir {self.config.data_dir} is used by another pagedllm serve (pid {owner}); pass --data-dir"
            log.warning(self.unavailable)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        return True

    def require(self) -> JobStore:
        if self.unavailable or self.store is None:
            raise Unavailable(self.unavailable or "the training job service is not running")
        return self.store

    def reconcile(self) -> None:
        """Follow again every job the store thought was running; the loop finalises the dead ones."""
        store = self.require()
        for job in store.jobs([JobState.RUNNING, JobState.CHECKPOINTING]):
            runs = store.runs(job.job_id)
            run = runs[-1] if runs else RunRecord(run=job.run, started_at=job.started_at or job.created_at)
            launcher = ProcessRef(job.pid or 0, job.pid_create_time or 0.0)
            active = self._follow(job, run, launcher, None)
            alive = launcher.alive()
            log.info("reconcile: job %s (%s) pid %s %s", job.job_id, job.status.value, job.pid,
                     "alive: re-attached" if alive else "gone")
            if alive and job.cancel_requested:
                active.kill_at = time.monotonic() + self.config.cancel_grace_s

    def _follow(self, job: JobRecord, run: RunRecord, launcher: ProcessRef, popen: subprocess.Popen | None) -> Active:
        monitor = JobMonitor(self.require(), job, run, JobPaths.of(self.config.data_dir, job.job_id).events)
        active = self.active[job.job_id] = Active(job, launcher, monitor, popen)
        return active

    # ---- the loop ----

    async def _loop(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(self.config.poll_interval_s)

    def tick(self) -> None:
        for active in list(self.active.values()):
            self._guarded(self._watch, active)
        self._guarded(self.schedule)
        self.cluster.sample()

    @staticmethod
    def _guarded(step, *args) -> None:
        """A bug met following one job must not stop the following of the others."""
        try:
            step(*args)
        except Exception:
            log.exception("job service: %s failed", getattr(step, "__name__", step))

    def _watch(self, active: Active) -> None:
        active.monitor.poll()
        if active.kill_at is not None and time.monotonic() >= active.kill_at:
            killed = kill_all(active.job.job_id)
            if killed:
                log.info("job %s: grace period over, SIGKILL to %s", active.job.job_id, killed)
        if not active.launcher_ended:
            if active.popen is not None:
                active.exit_code = active.popen.poll()
                active.launcher_ended = active.exit_code is not None
            else:
                active.launcher_ended = not active.launcher.alive()
        if not active.launcher_ended:
            return
        if kill_all(active.job.job_id):  # ranks orphaned by a launcher that died: finalise once they are gone
            return
        active.monitor.poll()  # the last events
        self._finalize(active)

    def _finalize(self, active: Active) -> None:
        job, store = active.job, self.require()
        sync_checkpoints(store, job)
        abandon_unfinished_saves(store, job)
        state, reason = outcome(job, active.exit_code, last_line(JobPaths.of(self.config.data_dir, job.job_id).log))
        job.exit_code = active.exit_code
        job.requested_checkpoint_id = None
        job.failure_reason = reason if state is JobState.FAILED else None
        transition = change_status(job, state, reason or "completed")
        run = active.monitor.run
        run.ended_at, run.exit_code, run.outcome = job.finished_at, active.exit_code, state.value
        store.save_run(job.job_id, run)
        store.save(job, [transition])
        del self.active[job.job_id]
        log.info("job %s %s%s", job.job_id, state.value, f": {reason}" if reason else "")

    def schedule(self) -> None:
        """Start PENDING jobs in queue order while they fit the free slots."""
        store = self.require()
        free = self.config.slots - self.slots_in_use()
        for job in startable(store.jobs([JobState.PENDING]), free):
            self._launch(job)

    def slots_in_use(self) -> int:
        return used_slots(a.job for a in self.active.values())

    # ---- launching ----

    def _launch(self, job: JobRecord) -> None:
        store = self.require()
        paths = JobPaths.of(self.config.data_dir, job.job_id)
        try:
            check_confined(job.config, self.roots)  # a symlink changed, or this server allows fewer folders
            check_runnable(job.config, job.world_size)
        except ConfigError as exc:  # e.g. the dataset went away while the job waited
            job.failure_reason = f"invalid config at launch: {exc}"
            store.save(job, [change_status(job, JobState.FAILED, job.failure_reason)])
            return
        self._prepare_run(job, paths)
        spec = LaunchSpec(job.job_id, job.world_size, paths, self.config.data_dir, job.resume_from)
        with open(paths.log, "a") as out:
            out.write(f"==== pagedllm job service: run {job.run} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(train_command(spec))}\n")
        try:
            popen, launcher = spawn(spec)
        except OSError as exc:
            job.failure_reason = f"could not start pagedllm train: {exc}"
            store.save(job, [change_status(job, JobState.FAILED, job.failure_reason)])
            return
        job.pid, job.pid_create_time, job.started_at = launcher.pid, launcher.create_time, time.time()
        run = RunRecord(run=job.run, started_at=job.started_at, resumed_from=job.resume_from)
        store.save_run(job.job_id, run)
        what = (f"resumed from checkpoint {job.resume_from}" if job.resume_from
                else "resuming from the newest intact checkpoint" if job.run > 1 else "started")
        store.save(job, [change_status(job, JobState.RUNNING, f"run {job.run} {what} (pid {launcher.pid}, {job.world_size} processes)")])
        self._follow(job, run, launcher, popen)

    def _prepare_run(self, job: JobRecord, paths: JobPaths) -> None:
        """Fresh per-run fields, the config file, no stale control requests, metrics cut at the resume step."""
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.config.write_text(json.dumps(job.config, indent=2))
        for name in (CHECKPOINT_REQUEST, STOP_REQUEST):
            (job.checkpoint_dir / "control" / name).unlink(missing_ok=True)
        if job.resume_from:
            record = self._checkpoint_record(job, job.resume_from)
            if record is not None:
                self.require().drop_metrics_after(job.job_id, int(record["step"]))
        job.run += 1
        job.events_offset = paths.events.stat().st_size if paths.events.exists() else 0
        job.processes, job.failures, job.finish = [], [], None
        job.exit_code = job.failure_reason = job.requested_checkpoint_id = None
        job.cancel_requested, job.finished_at = False, None

    # ---- requests ----

    def get(self, job_id: str) -> JobRecord:
        if job_id in self.active:
            return self.active[job_id].job
        job = self.require().get(job_id)
        if job is None:
            raise JobNotFound(f"no training job {job_id}")
        return job

    def submit(self, body: dict[str, Any]) -> JobRecord:
        """Validate and store a new job as PENDING (the next tick starts it when slots are free)."""
        store = self.require()
        job_id = str(uuid.uuid4())
        config, world = build_config(body, job_id, self.roots, self.config.slots)
        owners = {j.config["checkpoint_config"]["checkpoint_dir"]: j.job_id for j in store.jobs()}
        check_checkpoint_dir(config, job_id, owners)
        now = time.time()
        job = JobRecord(job_id=job_id, job_name=config.get("job_name", ""), status=JobState.PENDING, config=config,
                        world_size=world, queue_seq=store.next_queue_seq(), created_at=now, updated_at=now)
        paths = JobPaths.of(self.config.data_dir, job_id)
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.config.write_text(json.dumps(config, indent=2))
        store.add(job)
        log.info("job %s submitted: %s, %d processes", job_id, job.job_name, world)
        return job

    async def cancel(self, job_id: str, grace_s: float | None = None) -> JobState:
        """SIGTERM (stop at the next step boundary, checkpoint), SIGKILL after the grace period; returns
        once no process of the job is left."""
        job = self.get(job_id)
        if job.status is JobState.PENDING:
            self.require().save(job, [change_status(job, JobState.CANCELLED, "cancelled before it started")])
            return job.status
        if job.status.terminal:
            raise WrongState(f"job {job_id} is {job.status.value}: only PENDING, RUNNING or CHECKPOINTING jobs can be cancelled")
        active = self.active[job_id]  # every RUNNING/CHECKPOINTING job is followed (reconcile, _launch)
        grace = self.config.cancel_grace_s if grace_s is None else grace_s
        if not job.cancel_requested:
            job.cancel_requested = True
            self.require().save(job, [Transition(job.status, time.time(), f"cancel requested (grace {grace:g} s)")])
        signal_launcher(active.launcher, signal.SIGTERM)
        deadline = time.monotonic() + grace
        active.kill_at = min(active.kill_at or deadline, deadline)
        while job_id in self.active and time.monotonic() < deadline + 60:
            await asyncio.sleep(0.1)
        return self.get(job_id).status

    def request_checkpoint(self, job_id: str) -> str:
        """Ask the running job to save at its next step boundary, under an id chosen here. While a
        requested checkpoint is still to be saved, asking again answers the same id."""
        job = self.get(job_id)
        if not job.status.active or job.cancel_requested:
            state = "being cancelled" if job.cancel_requested else job.status.value
            raise WrongState(f"job {job_id} is {state}: a checkpoint can be requested only while it is RUNNING")
        if job.requested_checkpoint_id is not None:
            return job.requested_checkpoint_id
        checkpoint_id = str(uuid.uuid4())
        control = job.checkpoint_dir / "control"
        control.mkdir(parents=True, exist_ok=True)
        staged = control / f".{checkpoint_id}.request"
        staged.write_text(json.dumps({"checkpoint_id": checkpoint_id}))
        os.replace(staged, control / CHECKPOINT_REQUEST)  # the trainer never sees half a file
        job.requested_checkpoint_id = checkpoint_id
        reason = f"checkpoint {checkpoint_id} requested"
        if job.status is JobState.CHECKPOINTING:  # a periodic save is under way: stay, note the request
            transition = Transition(job.status, time.time(), reason)
        else:
            transition = change_status(job, JobState.CHECKPOINTING, reason)
        self.require().save(job, [transition])
        return checkpoint_id

    def resume(self, job_id: str, checkpoint_id: str | None) -> JobState:
        """Queue a FAILED or CANCELLED job again, to continue from a COMPLETE checkpoint."""
        job, store = self.get(job_id), self.require()
        if job.status not in RESUMABLE:
            raise WrongState(f"job {job_id} is {job.status.value}: only FAILED or CANCELLED jobs can be resumed")
        sync_checkpoints(store, job)
        abandon_unfinished_saves(store, job)
        record = self._resume_point(job, checkpoint_id)
        # A named checkpoint is used or the run fails; otherwise the trainer takes the newest COMPLETE checkpoint
        # whose checksums still match, falling back to older ones (and says so in the history and the log).
        job.resume_from = record["checkpoint_id"] if checkpoint_id is not None else None
        job.queue_seq = store.next_queue_seq()
        job.failure_reason, job.finished_at = None, None
        what = (f"resume from checkpoint {record['checkpoint_id']} (step {record['step']}) requested" if checkpoint_id
                else f"resume requested: from the newest intact COMPLETE checkpoint (now {record['checkpoint_id']}, "
                     f"step {record['step']})")
        store.save(job, [change_status(job, JobState.PENDING, what)])
        self.schedule()
        return self.get(job_id).status

    def _resume_point(self, job: JobRecord, checkpoint_id: str | None) -> dict:
        if checkpoint_id is not None:
            record = self._checkpoint_record(job, checkpoint_id)
            if record is None:
                raise JobNotFound(f"job {job.job_id} has no checkpoint {checkpoint_id}", param="checkpoint_id")
            if record["status"] != CheckpointStatus.COMPLETE.value:
                raise WrongState(f"checkpoint {checkpoint_id} is {record['status']}: only a COMPLETE checkpoint can be resumed from")
            return record
        complete = [r for r in self.require().checkpoints(job.job_id) if r["status"] == CheckpointStatus.COMPLETE.value]
        if not complete:
            raise WrongState(f"job {job.job_id} has no COMPLETE checkpoint to resume from")
        return max(complete, key=lambda r: r["step"])

    def _checkpoint_record(self, job: JobRecord, checkpoint_id: str) -> dict | None:
        return next((r for r in self.require().checkpoints(job.job_id) if r["checkpoint_id"] == str(checkpoint_id)), None)

    def checkpoints(self, job_id: str) -> list[dict]:
        job = self.get(job_id)
        if job.status.active:
            sync_checkpoints(self.require(), job)
        return self.require().checkpoints(job_id)

    def log_path(self, job_id: str) -> Path:
        self.get(job_id)
        return JobPaths.of(self.config.data_dir, job_id).log


def last_line(path: Path, window: int = 8192) -> str | None:
    """The last non-empty line of a log (a failure reason of last resort, when no rank reported one)."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, path.stat().st_size - window))
            lines = [line.strip() for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1][:500] if lines else None
