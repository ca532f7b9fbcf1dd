"""The service in-process, on its own store: reconciling jobs the store thought were running (a reused
pid is not the job; a live launcher is re-attached; one that finished meanwhile is COMPLETED),
escalating a cancel to SIGKILL when the processes ignore SIGTERM, cancelling a PENDING job, and one
server per data dir.

Stand-in processes (a shell tagged like a job's launcher) play the job where the behaviour under test
is the service's own: a real trainer stops cleanly on SIGTERM, so it never needs the SIGKILL; and the
real-job paths are covered end to end in test_lifecycle.py and test_queue_restart.py."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from pathlib import Path

import psutil
import pytest

from pagedllm.jobs.launcher import JobPaths, ProcessRef
from pagedllm.jobs.records import JobRecord, JobState
from pagedllm.jobs.service import JobService, WrongState
from pagedllm.jobs.settings import JobServiceConfig

from .helpers import alive, job_body, job_processes, stand_in


def service(data_dir, slots: int = 2, grace: float = 10.0, allowed: tuple[Path, ...] = ()) -> JobService:
    return JobService(JobServiceConfig(data_dir, slots, cancel_grace_s=grace, poll_interval_s=0.05, allowed_paths=allowed))


def running_record(tmp_path, launcher: ProcessRef) -> JobRecord:
    job_id = str(uuid.uuid4())
    return JobRecord(job_id=job_id, job_name="stand-in", status=JobState.RUNNING, world_size=1, queue_seq=1,
                     created_at=time.time(), updated_at=time.time(), run=1, pid=launcher.pid,
                     pid_create_time=launcher.create_time,
                     config={"checkpoint_config": {"checkpoint_dir": str(tmp_path / "ckpt" / job_id)}})


@contextmanager
def opened(data_dir, **options) -> Iterator[JobService]:
    """A service that owns `data_dir` (reconciled), ticked by hand."""
    svc = service(data_dir, **options)
    assert svc.open()
    try:
        yield svc
    finally:
        svc.close()


def seed(data_dir, job: JobRecord) -> None:
    """The store as a previous server left it."""
    with opened(data_dir) as svc:
        svc.store.add(job)


def test_a_reused_pid_is_not_the_job(tmp_path):
    me = psutil.Process()
    job = running_record(tmp_path, ProcessRef(me.pid, me.create_time() - 1000))  # our pid, another start time
    seed(tmp_path, job)
    with opened(tmp_path) as svc:
        svc.tick()
        failed = svc.get(job.job_id)
        assert failed.status is JobState.FAILED and failed.job_id not in svc.active
        assert "ended while the server was not watching" in failed.failure_reason
        assert alive(me.pid)


def test_a_job_that_completed_while_no_server_watched(tmp_path):
    proc = subprocess.Popen(["sleep", "0.1"])
    launcher = ProcessRef.of(proc.pid)
    proc.wait()
    job = running_record(tmp_path, launcher)
    events = JobPaths.of(tmp_path, job.job_id).events
    events.parent.mkdir(parents=True)
    events.write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "started", "step": 0, "processes": [{"rank": 0, "pid": proc.pid, "host": "h"}]},
        {"event": "step", "step": 1, "loss": 2.0}, {"event": "finished", "reason": "completed", "step": 1, "exit_code": 0}]))
    seed(tmp_path, job)
    with opened(tmp_path) as svc:
        svc.tick()
        done = svc.get(job.job_id)
        assert done.status is JobState.COMPLETED and done.failure_reason is None
        assert [m["step"] for m in svc.store.metrics(job.job_id)] == [1]


def test_reattached_job_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    job_id = str(uuid.uuid4())
    proc = stand_in(job_id, tmp_path, "trap '' TERM; sleep 60 & wait")
    try:
        time.sleep(0.2)  # bash has set its trap and started sleep
        job = running_record(tmp_path, ProcessRef.of(proc.pid))
        job.job_id = job_id
        seed(tmp_path, job)

        async def scenario() -> tuple[JobState, float]:
            svc = service(tmp_path, grace=0.5)
            await svc.start()
            try:
                await asyncio.sleep(0.2)
                assert svc.get(job_id).status is JobState.RUNNING and job_id in svc.active  # re-attached
                began = time.monotonic()
                state = await svc.cancel(job_id)
                return state, time.monotonic() - began
            finally:
                await svc.stop()

        state, took = asyncio.run(scenario())
        assert state is JobState.CANCELLED and 0.5 <= took < 10
        assert not job_processes(job_id), "bash and its sleep must both be gone"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()


def test_pending_job_is_cancelled_without_starting(tmp_path, tiny_paths):
    with opened(tmp_path / "data", allowed=(tiny_paths["corpus"].parent,)) as svc:
        job = asyncio.run(svc.submit(job_body(tiny_paths, ranks=1, steps=3)))
        assert asyncio.run(svc.cancel(job.job_id)) is JobState.CANCELLED
        asyncio.run(svc.schedule())  # nothing to start
        assert not svc.active and svc.get(job.job_id).run == 0
        assert [t.status for t in svc.store.history(job.job_id)] == [JobState.PENDING, JobState.CANCELLED]
        with pytest.raises(WrongState, match="only PENDING, RUNNING or CHECKPOINTING"):
            asyncio.run(svc.cancel(job.job_id))


def test_one_server_per_data_dir(tmp_path):
    with opened(tmp_path):
        second = service(tmp_path)
        assert not second.open() and f"(pid {os.getpid()})" in second.unavailable
    with opened(tmp_path):  # released by close()
        pass
