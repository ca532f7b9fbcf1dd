"""The job service: the component `create_app` runs (async start/stop) behind /v1/training and /v1/cluster.

One asyncio task ticks every `poll_interval_s`: each running job's events go into the store, a
cancel past its grace period escalates to SIGKILL, a job whose launcher has exited is finalised once
no process of it is left, and PENDING jobs start in queue order while slots are free.

On start the service reconciles: every job the store thought RUNNING or CHECKPOINTING is looked up
by pid *and* start time. Alive, it is followed again from the events it had not yet read; gone, its
remaining events are read and it ends as the events say (COMPLETED if it finished meanwhile, else
FAILED with the reason). Running jobs outlive a server stop: they are in sessions of their own.

One server owns a data dir at a time (an flock); a second one answers 503 on these routes.

With `--cluster ray` the slots are the Ray cluster's (ray_cluster.py): the head of the queue gets a
placement group, and it starts once Ray has reserved all of it; its ranks run as Ray actors and are
followed through them (logs, events, exit codes, a node that died) instead of a local launcher.
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
from pagedllm.jobs.launcher import (
    JobPaths,
    LaunchSpec,
    ProcessRef,
    job_environment,
    kill_all,
    signal_launcher,
    spawn,
    train_command,
)
from pagedllm.jobs.monitor import METRIC_KEYS, JobMonitor, abandon_unfinished_saves, change_status, outcome, sync_checkpoints
from pagedllm.jobs.ray_cluster import RayCluster, RayRun, ray_address
from pagedllm.jobs.records import RESUMABLE, JobRecord, JobState, RunRecord, Transition
from pagedllm.jobs.schemas import ClusterNode, ClusterStatus, NodeJob
from pagedllm.jobs.slots import startable, used_slots
from pagedllm.jobs.settings import DEFAULT_MAX_PENDING_JOBS, JobServiceConfig
from pagedllm.jobs.store import JobStore, SQLiteJobStore
from pagedllm.jobs.submission import build_config, check_checkpoint_dir, check_runnable
from pagedllm.training.checkpoint import CheckpointStatus
from pagedllm.training.config import ConfigError, parse_job
from pagedllm.training.control import CHECKPOINT_REQUEST, STOP_REQUEST
from pagedllm.training.progress import read_metrics
from pagedllm.training.provenance import service_key

log = logging.getLogger("pagedllm.jobs")


class JobNotFound(LookupError):
    def __init__(self, what: str, param: str = "job_id") -> None:
        super().__init__(what)
        self.param = param


class WrongState(RuntimeError):
    """The job is not in a state that allows the request (HTTP 409)."""


class Unavailable(RuntimeError):
    """The service cannot serve (no data dir, or another server owns it)."""


class QueueFull(RuntimeError):
    """As many jobs are PENDING as the server allows (HTTP 429)."""


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
    ray_run: RayRun | None = None  # on a Ray cluster: the ranks (there is no local launcher)


class JobService:
    def __init__(self, config: JobServiceConfig | None, unavailable: str | None = None) -> None:
        self.config = config
        self.unavailable = unavailable  # why the routes answer 503, if they do
        self.roots = AllowedRoots(config.data_dir, config.allowed_paths) if config is not None else None
        self.store: JobStore | None = None
        self.cluster: ClusterMonitor | None = None
        self.ray: RayCluster | None = None  # with --cluster ray: the backend that places and runs jobs
        self.active: dict[str, Active] = {}  # job_id -> the job's processes and monitor
        self._task: asyncio.Task | None = None
        self._scheduling = asyncio.Lock()  # one scheduling pass at a time: the loop's, or a resume's
        self._lock_fd: int | None = None
        self.key = b""  # the checkpoint key, read once the data dir is ours (open)

    @classmethod
    def from_settings(cls, data_dir: str | None, slots: int | None, allowed_paths: list[str] | tuple[str, ...] = (),
                      cluster: str | None = None, max_pending_jobs: int = DEFAULT_MAX_PENDING_JOBS) -> JobService:
        if data_dir is None:
            return cls(None, unavailable="the training job service needs a data dir (pagedllm serve --data-dir DIR)")
        return cls(JobServiceConfig(Path(data_dir).expanduser().resolve(), slots or default_slots(),
                                    allowed_paths=tuple(Path(p) for p in allowed_paths), cluster=cluster,
                                    max_pending_jobs=max_pending_jobs))

    # ---- lifecycle ----

    async def start(self) -> None:
        if self.open():
            self._task = asyncio.create_task(self._loop(), name="pagedllm-jobs")

    def open(self) -> bool:
        """Own the data dir, open the store, reconcile; False if the service cannot serve."""
        if self.config is None or not self._acquire_data_dir():
            return False
        self.store = SQLiteJobStore(self.config.data_dir / "jobs.db")
        self.key = service_key(self.config.data_dir)  # signs the checkpoints of the jobs it launches
        self.cluster = ClusterMonitor(self.config.slots)
        if self.config.cluster is not None:
            self.ray = RayCluster(ray_address(self.config.cluster))
            self.ray.open()
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
        for active in self.active.values():
            if active.ray_run is not None:  # ranks are the server's actors: they end with it (and are told so)
                active.ray_run.kill()
        self.active.clear()
        if self.ray is not None:
            self.ray.close()
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
        monitor = JobMonitor(self.require(), job, run, JobPaths.of(self.config.data_dir, job.job_id).events, self.key)
        active = self.active[job.job_id] = Active(job, launcher, monitor, popen)
        return active

    # ---- the loop ----

    async def _loop(self) -> None:
        while True:
            self.tick()
            try:
                await self.schedule()
            except Exception:
                log.exception("job service: schedule failed")
            await asyncio.sleep(self.config.poll_interval_s)

    def tick(self) -> None:
        """Follow the running jobs and sample the cluster (quick: no dataset walk; `schedule` starts jobs)."""
        for active in list(self.active.values()):
            self._guarded(self._watch, active)
        if self.ray is not None:
            self._guarded(self.ray.sample)
        else:
            self.cluster.sample()

    @staticmethod
    def _guarded(step, *args) -> None:
        """A bug met following one job must not stop the following of the others."""
        try:
            step(*args)
        except Exception:
            log.exception("job service: %s failed", getattr(step, "__name__", step))

    def _watch(self, active: Active) -> None:
        if active.ray_run is not None:
            self._watch_ranks(active)
        active.monitor.poll()
        if active.ray_run is not None:
            self._annotate_ranks(active)
        if active.kill_at is not None and time.monotonic() >= active.kill_at:
            if active.ray_run is not None:
                active.ray_run.kill()
            killed = kill_all(active.job.job_id)
            if killed:
                log.info("job %s: grace period over, SIGKILL to %s", active.job.job_id, killed)
        if active.ray_run is not None:
            if active.ray_run.ended and self._node_deaths_settled(active):
                active.exit_code, active.launcher_ended = active.ray_run.exit_code, True
        elif not active.launcher_ended:
            if active.popen is not None:
                active.exit_code = active.popen.poll()
                active.launcher_ended = active.exit_code is not None
            else:
                active.launcher_ended = not active.launcher.alive()
        if not active.launcher_ended:
            return
        if active.ray_run is None and kill_all(active.job.job_id):  # ranks orphaned by a launcher that died
            return
        active.monitor.poll()  # the last events
        self._finalize(active)

    def _finalize(self, active: Active) -> None:
        job, store = active.job, self.require()
        sync_checkpoints(store, job, self.key)
        abandon_unfinished_saves(store, job)
        ended = None
        if active.ray_run is not None:
            ended = active.ray_run.describe_end()
            self.ray.retire(active.ray_run)
            backfill_metrics(store, job)
        state, reason = outcome(job, active.exit_code, last_line(JobPaths.of(self.config.data_dir, job.job_id).log), ended)
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

    async def schedule(self) -> None:
        """Start PENDING jobs in queue order while they fit the free slots."""
        async with self._scheduling:
            store = self.require()
            if self.ray is not None:
                return await self._schedule_on_ray(store.jobs([JobState.PENDING]))
            free = self.config.slots - self.slots_in_use()
            for job in startable(store.jobs([JobState.PENDING]), free):
                await self._start(job)

    async def _schedule_on_ray(self, pending: list[JobRecord]) -> None:
        """Strict FIFO over placement groups: the head of the queue asks Ray for its bundles, and nothing
        behind it starts before Ray has reserved all of them."""
        for job in sorted(pending, key=lambda j: j.queue_seq):
            group = self.ray.reserve(job.job_id, job.world_size, job.run + 1)
            if group is None:
                return
            await self._start(job, group)

    async def _start(self, job: JobRecord, group=None) -> None:
        """Check the job again (its dataset walk on a worker thread, never on the event loop), then
        launch it if it is still the PENDING job it was (not cancelled or re-queued meanwhile)."""
        problem = await asyncio.to_thread(self._launch_problem, job)
        current = self.require().get(job.job_id)
        if current is None or current.status is not JobState.PENDING or current.queue_seq != job.queue_seq:
            if group is not None:
                self.ray.release_group(group)
            return
        self._launch(current, group, problem)

    def _launch_problem(self, job: JobRecord) -> str | None:
        """Why the job can no longer run (e.g. the dataset went away while it waited, a symlink changed,
        this server allows fewer folders), or None."""
        try:
            check_confined(job.config, self.roots)
            check_runnable(job.config, job.world_size)
        except ConfigError as exc:
            return str(exc)
        return None

    def slots_in_use(self) -> int:
        return used_slots(a.job for a in self.active.values())

    def _slots_name(self) -> str:
        if self.ray is not None:
            return f"{self.ray.unit}s of the Ray cluster's live nodes"
        return "training slots of this server (--train-slots)"

    def capacity(self) -> int:
        """Slots a job may use at most: --train-slots, or the live Ray nodes' CPUs (GPUs)."""
        return self.ray.capacity() if self.ray is not None else self.config.slots

    # ---- launching ----

    def _launch(self, job: JobRecord, group=None, problem: str | None = None) -> None:
        store = self.require()
        paths = JobPaths.of(self.config.data_dir, job.job_id)
        if problem is not None:
            if group is not None:
                self.ray.release_group(group)
            job.failure_reason = f"invalid config at launch: {problem}"
            store.save(job, [change_status(job, JobState.FAILED, job.failure_reason)])
            return
        self._prepare_run(job, paths)
        if group is not None:
            return self._launch_on_ray(job, paths, group)
        spec = LaunchSpec(job.job_id, job.world_size, paths, self.config.data_dir, job.resume_from, self.roots.roots)
        with open(paths.log, "a") as out:
            out.write(f"==== pagedllm job service: run {job.run} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(train_command(spec))}\n")
        try:
            popen, launcher = spawn(spec)
        except OSError as exc:
            job.failure_reason = f"could not start pagedllm train: {exc}"
            store.save(job, [change_status(job, JobState.FAILED, job.failure_reason)])
            return
        job.pid, job.pid_create_time = launcher.pid, launcher.create_time
        run = self._record_start(job, f"pid {launcher.pid}, {job.world_size} processes")
        self._follow(job, run, launcher, popen)

    def _record_start(self, job: JobRecord, where: str) -> RunRecord:
        """The new run's record, and RUNNING with what started where."""
        store = self.require()
        job.started_at = time.time()
        run = RunRecord(run=job.run, started_at=job.started_at, resumed_from=job.resume_from)
        store.save_run(job.job_id, run)
        what = (f"resumed from checkpoint {job.resume_from}" if job.resume_from
                else "resuming from the newest intact checkpoint" if job.run > 1 else "started")
        store.save(job, [change_status(job, JobState.RUNNING, f"run {job.run} {what} ({where})")])
        return run

    def _launch_on_ray(self, job: JobRecord, paths: JobPaths, group) -> None:
        """The ranks as actors in the job's placement group (the same worker arguments as torchrun's)."""
        store = self.require()
        args = ["--resume-from", job.resume_from] if job.resume_from else []
        with open(paths.log, "a") as out:
            out.write(f"==== pagedllm job service: run {job.run} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{job.world_size} ranks on the Ray cluster, pagedllm.training.worker {' '.join(args)}\n")
        try:
            environment = job_environment(job.job_id, self.config.data_dir, self.roots.roots)
            run = self.ray.launch(job.job_id, group, job.config, args, environment, paths.log, paths.events)
        except Exception as exc:  # an actor that could not start: nothing of the job runs
            self.ray.release_group(group)
            job.failure_reason = f"could not start the ranks on the Ray cluster: {exc}"
            store.save(job, [change_status(job, JobState.FAILED, job.failure_reason)])
            return
        job.pid, job.pid_create_time = None, None
        job.processes = [{"rank": r.rank, "pid": r.pid, "host": r.host, "node_id": r.node_id, "address": r.address}
                         for r in run.ranks]
        nodes = sorted({r.node_id[:12] for r in run.ranks})
        record = self._record_start(job, f"{job.world_size} ranks on Ray node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}")
        active = self._follow(job, record, ProcessRef(0, 0.0), None)
        active.ray_run = run

    def _watch_ranks(self, active: Active) -> None:
        """Drain the ranks; once one failed or was lost, the others get RANK_FAILURE_GRACE_S to report why."""
        run = active.ray_run
        run.poll()
        if run.first_failure_at is not None and not run.ended and active.kill_at is None:
            active.kill_at = run.first_failure_at + self.config.rank_failure_grace_s

    @staticmethod
    def _annotate_ranks(active: Active) -> None:
        """The trainer's "started" event knows the ranks' pids, Ray knows their nodes: the job shows both."""
        where = {r.rank: r for r in active.ray_run.ranks}
        for process in active.job.processes:
            rank = where.get(process.get("rank"))
            if rank is not None:
                process.setdefault("node_id", rank.node_id)
                process.setdefault("address", rank.address)
                if process.get("pid") is None:
                    process["pid"] = rank.pid

    def _node_deaths_settled(self, active: Active) -> bool:
        """A rank's actor may die before Ray has decided that its node did: wait for that decision up to
        the failure grace period, so the failure names the node's death when it was one."""
        run = active.ray_run
        if not run.lost or run.check_nodes():
            return True
        return time.monotonic() >= run.first_failure_at + self.config.rank_failure_grace_s

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

    async def submit(self, body: dict[str, Any]) -> JobRecord:
        """Validate and store a new job as PENDING (the next tick starts it when slots are free). The
        validation walks the dataset: on a worker thread, so the event loop serves on meanwhile."""
        store = self.require()
        self._check_queue_room()
        job_id = str(uuid.uuid4())
        config, world = await asyncio.to_thread(build_config, body, job_id, self.roots, self.capacity(), self._slots_name())
        self._check_queue_room()  # others may have been queued while this one was checked
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
            if self.ray is not None:
                self.ray.release(job_id)
            self.require().save(job, [change_status(job, JobState.CANCELLED, "cancelled before it started")])
            return job.status
        if job.status.terminal:
            raise WrongState(f"job {job_id} is {job.status.value}: only PENDING, RUNNING or CHECKPOINTING jobs can be cancelled")
        active = self.active[job_id]  # every RUNNING/CHECKPOINTING job is followed (reconcile, _launch)
        grace = self.config.cancel_grace_s if grace_s is None else grace_s
        if not job.cancel_requested:
            job.cancel_requested = True
            self.require().save(job, [Transition(job.status, time.time(), f"cancel requested (grace {grace:g} s)")])
        if active.ray_run is not None:
            active.ray_run.signal(signal.SIGTERM)
        else:
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

    def _check_queue_room(self) -> None:
        limit = self.config.max_pending_jobs
        if len(self.require().jobs([JobState.PENDING])) >= limit:
            raise QueueFull(f"{limit} training jobs are already waiting to start, the most this server queues "
                            "(pagedllm serve --max-pending-jobs); submit again once one has started or been cancelled")

    async def resume(self, job_id: str, checkpoint_id: str | None, data_parallel_size: int | None = None) -> JobState:
        """Queue a FAILED or CANCELLED job again, to continue from a COMPLETE checkpoint — with
        `data_parallel_size`, on that many replicas (a cluster that lost a node: the checkpoint is
        resharded, the global batch stays, so the steps are the same)."""
        job, store = self._resumable(job_id), self.require()
        sync_checkpoints(store, job, self.key)
        abandon_unfinished_saves(store, job)
        record = self._resume_point(job, checkpoint_id)
        self._check_queue_room()
        resized = None
        if data_parallel_size is not None:  # checked as a submission is: on a worker thread
            resized = await asyncio.to_thread(self._resized, job, data_parallel_size)
            self._resumable(job_id)  # still: not resumed by another request meanwhile
        if resized is None and job.world_size > self.capacity():
            raise WrongState(f"job {job_id} needs {job.world_size} slots but the {self._slots_name()} are "
                             f"{self.capacity()}: resume it with a smaller data_parallel_size")
        if resized is not None:
            job.config, job.world_size = resized
        # A named checkpoint is used or the run fails; otherwise the trainer takes the newest COMPLETE checkpoint
        # whose checksums still match, falling back to older ones (and says so in the history and the log).
        job.resume_from = record["checkpoint_id"] if checkpoint_id is not None else None
        job.queue_seq = store.next_queue_seq()
        job.failure_reason, job.finished_at = None, None
        what = (f"resume from checkpoint {record['checkpoint_id']} (step {record['step']}) requested" if checkpoint_id
                else f"resume requested: from the newest intact COMPLETE checkpoint (now {record['checkpoint_id']}, "
                     f"step {record['step']})")
        store.save(job, [change_status(job, JobState.PENDING, what)])
        await self.schedule()
        return self.get(job_id).status

    def _resumable(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if job.status not in RESUMABLE:
            raise WrongState(f"job {job_id} is {job.status.value}: only FAILED or CANCELLED jobs can be resumed")
        return job

    def _resized(self, job: JobRecord, data_parallel_size: int) -> tuple[dict, int]:
        """The job's config with another data_parallel_size, checked as a new submission would be."""
        config = json.loads(json.dumps(job.config))
        config.setdefault("parallelism_config", {})["data_parallel_size"] = data_parallel_size
        world = parse_job(config).parallelism.world_size
        if world > self.capacity():
            raise ConfigError("data_parallel_size", f"the job would need {world} processes, more than the "
                                                    f"{self.capacity()} {self._slots_name()}")
        check_runnable(config, world)
        return config, world

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
            sync_checkpoints(self.require(), job, self.key)
        return self.require().checkpoints(job_id)

    # ---- the cluster ----

    def node_jobs(self) -> dict[str, list[NodeJob]]:
        """node id -> the jobs with ranks there (on one node: every running job, on the local node)."""
        out: dict[str, dict[str, list[int]]] = {}
        for active in self.active.values():
            for process in active.job.processes or [{"rank": r} for r in range(active.job.world_size)]:
                node = process.get("node_id") or self.cluster.node_id
                out.setdefault(node, {}).setdefault(active.job.job_id, []).append(process.get("rank"))
        return {node: [NodeJob(job_id=j, ranks=sorted(r for r in ranks if r is not None)) for j, ranks in jobs.items()]
                for node, jobs in out.items()}

    def cluster_status(self) -> ClusterStatus:
        store = self.require()
        pending = len(store.jobs([JobState.PENDING]))
        if self.ray is None:
            return self.cluster.status(self.slots_in_use(), len(self.active), pending)
        nodes = self.ray.nodes()
        samples = [n["sample"] for n in nodes if n["sample"]]
        used = sum(sum(s["memory_used"]) for s in samples)
        total = sum(sum(s["memory_total"]) for s in samples)
        return ClusterStatus(
            device_type=self.ray.device_type, total_gpus=sum(n["slots"] for n in nodes if n["alive"]),
            available_gpus=sum(n["free_slots"] for n in nodes),
            gpu_utilization=round(sum(s["utilization"] for s in samples) / len(samples), 4) if samples else 0.0,
            memory_utilization=round(used / total, 4) if total else 0.0, active_jobs=len(self.active), pending_jobs=pending)

    def cluster_nodes(self) -> list[ClusterNode]:
        self.require()
        jobs = self.node_jobs()
        if self.ray is None:
            return [node.model_copy(update={"jobs": jobs.get(node.node_id, [])})
                    for node in self.cluster.nodes(self.slots_in_use())]
        out = []
        for node in self.ray.nodes():
            sample = node["sample"] or {}
            status = "dead" if not node["alive"] else "busy" if node["free_slots"] == 0 else "ready"
            out.append(ClusterNode(
                node_id=node["node_id"], gpus=node["slots"], device_type=self.ray.device_type, status=status,
                gpu_memory_used=[round(x, 3) for x in sample.get("memory_used", [])],
                memory_total=[round(x, 3) for x in sample.get("memory_total", [node["memory"] / 1024 ** 3])],
                address=node["address"], hostname=node["hostname"], alive=node["alive"], cpus=node["cpus"],
                gpu_count=node["gpus"], free_slots=node["free_slots"], jobs=jobs.get(node["node_id"], [])))
        return out

    def log_path(self, job_id: str) -> Path:
        self.get(job_id)
        return JobPaths.of(self.config.data_dir, job_id).log


def backfill_metrics(store: JobStore, job: JobRecord) -> None:
    """Step records the events never brought (a Ray run whose rank 0 died with its node before its last
    lines were drained), from rank 0's metrics.jsonl in the shared checkpoint_dir: a resume may start
    after steps the store would otherwise lack."""
    latest = (store.latest_metrics(job.job_id) or {}).get("step") or 0
    missing = [{k: r[k] for k in METRIC_KEYS if k in r} for r in read_metrics(job.checkpoint_dir / "metrics.jsonl")
               if r.get("step", 0) > latest]
    if missing:
        store.add_metrics(job.job_id, job.run, missing)


def last_line(path: Path, window: int = 8192) -> str | None:
    """The last non-empty line of a log (a failure reason of last resort, when no rank reported one)."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, path.stat().st_size - window))
            lines = [line.strip() for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1][:500] if lines else None
