"""The monitor: the events file read incrementally, events applied to the store, and how a run's end
is judged (completed, cancelled, stopped from outside, failed with the ranks' reasons)."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import pytest

from pagedllm.jobs.monitor import EventFollower, JobMonitor, abandon_unfinished_saves, outcome, sync_checkpoints
from pagedllm.jobs.records import JobRecord, JobState, RunRecord
from pagedllm.jobs.store import SQLiteJobStore
from pagedllm.training.checkpoint import Checkpoint, CheckpointMetadata, CheckpointStatus, step_dir_name, write_manifest
from pagedllm.training.provenance import current_key


def append(path, *events, end="\n") -> None:
    with open(path, "a") as file:
        file.write("".join(json.dumps(e) + "\n" for e in events[:-1]) + json.dumps(events[-1]) + end)


def test_follower_waits_for_whole_lines_and_skips_garbage(tmp_path):
    path = tmp_path / "events.jsonl"
    follower = EventFollower(path)
    assert follower.read() == []  # no file yet
    append(path, {"event": "a"}, {"event": "b"}, end="")  # the last line is still being written
    assert follower.read() == [{"event": "a"}]
    with open(path, "a") as file:
        file.write("\nnot json\n[1]\n")
    assert follower.read() == [{"event": "b"}]
    assert follower.offset == path.stat().st_size
    assert EventFollower(path, follower.offset).read() == []  # a restarted follower goes on from the saved offset


def job_record(tmp_path, job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, job_name="j", status=JobState.RUNNING, world_size=2, queue_seq=1, created_at=1.0,
                     updated_at=1.0, run=1, config={"checkpoint_config": {"checkpoint_dir": str(tmp_path / "ckpt")}})


def manifest(tmp_path, job_id: str, step: int, status: CheckpointStatus, checkpoint_id: uuid.UUID) -> str:
    folder = tmp_path / "ckpt" / step_dir_name(step)
    folder.mkdir(parents=True, exist_ok=True)
    write_manifest(folder, Checkpoint(
        checkpoint_id=checkpoint_id, job_id=uuid.UUID(job_id), step=step, timestamp=datetime.now(timezone.utc),
        status=status, metadata=CheckpointMetadata(learning_rate=0.1, global_step=step, consumed_tokens=64 * step,
                                                   elapsed_time_seconds=1.0)))
    return str(folder)


def test_events_become_metrics_checkpoints_and_states(tmp_path):
    job_id = str(uuid.uuid4())
    store = SQLiteJobStore(tmp_path / "jobs.db")
    job = job_record(tmp_path, job_id)
    store.add(job)
    run = RunRecord(run=1, started_at=1.0)
    events = tmp_path / "events.jsonl"
    monitor = JobMonitor(store, job, run, events, current_key())
    ckpt = uuid.uuid4()
    job.requested_checkpoint_id = str(ckpt)
    path = manifest(tmp_path, job_id, 2, CheckpointStatus.SAVING, ckpt)
    append(events,
           {"event": "started", "step": 0, "processes": [{"rank": 0, "pid": 11, "host": "h"}, {"rank": 1, "pid": 12, "host": "h"}]},
           {"event": "step", "step": 1, "loss": 3.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 9.0, "consumed_tokens": 64, "time": 5},
           {"event": "step", "step": 2, "loss": 2.5, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 9.0, "consumed_tokens": 128},
           {"event": "checkpoint", "status": "SAVING", "checkpoint_id": str(ckpt), "step": 2, "path": path})
    monitor.poll()
    assert job.status is JobState.CHECKPOINTING and [p["pid"] for p in job.processes] == [11, 12]
    assert [m["step"] for m in store.metrics(job_id)] == [1, 2] and "time" not in store.metrics(job_id)[0]
    assert store.runs(job_id)[0].start_step == 0
    assert [c["status"] for c in store.checkpoints(job_id)] == ["SAVING"]

    manifest(tmp_path, job_id, 2, CheckpointStatus.COMPLETE, ckpt)
    append(events, {"event": "checkpoint", "status": "COMPLETE", "checkpoint_id": str(ckpt), "step": 2, "path": path},
           {"event": "failed", "rank": 1, "reason": "ValueError: x"},
           {"event": "finished", "reason": "stopped", "step": 2, "exit_code": 143})
    monitor.poll()
    assert job.status is JobState.RUNNING and job.requested_checkpoint_id is None
    assert store.checkpoints(job_id)[0]["status"] == "COMPLETE" and store.checkpoints(job_id)[0]["path"] == path
    saved = store.get(job_id)
    assert saved.events_offset == events.stat().st_size and saved.failures[0]["reason"] == "ValueError: x"
    assert saved.finish == {"reason": "stopped", "step": 2, "exit_code": 143, "time": None}
    assert [t.status for t in store.history(job_id)][-2:] == [JobState.CHECKPOINTING, JobState.RUNNING]

    manifest(tmp_path, job_id, 3, CheckpointStatus.SAVING, uuid.uuid4())
    sync_checkpoints(store, job, current_key())
    abandon_unfinished_saves(store, job)  # the job died mid-save
    assert [c["status"] for c in store.checkpoints(job_id)] == ["COMPLETE", "CORRUPT"]


def ended(finish=None, failures=(), cancel=False, processes=()) -> JobRecord:
    job = JobRecord(job_id="j", job_name="j", status=JobState.RUNNING, config={}, world_size=2, queue_seq=1,
                    created_at=0.0, updated_at=0.0)
    job.finish, job.failures, job.cancel_requested = finish, list(failures), cancel
    job.processes = list(processes)
    return job


COMPLETED = {"reason": "completed", "step": 9, "exit_code": 0}
STOPPED = {"reason": "stopped", "step": 4, "exit_code": 143}


@pytest.mark.parametrize("job, exit_code, state, reason", [
    (ended(COMPLETED), 0, JobState.COMPLETED, None),
    (ended(COMPLETED), None, JobState.COMPLETED, None),  # finished while the server was down
    (ended(COMPLETED, cancel=True), 0, JobState.COMPLETED, None),  # the cancel came too late
    (ended(STOPPED, cancel=True), 1, JobState.CANCELLED, "cancelled by request at step 4"),
    (ended(None, cancel=True), -9, JobState.CANCELLED, "cancelled by request"),
    (ended(STOPPED), 1, JobState.CANCELLED, "stopped from outside the job service (signal 15) at step 4"),
    (ended(None), -9, JobState.FAILED, "the launcher was killed by signal 9; no rank reported an error"),
    (ended(None), None, JobState.FAILED, "ended while the server was not watching them"),
    (ended(COMPLETED), 1, JobState.COMPLETED, "then the launcher exited with code 1: a rank failed while shutting down"),
    (ended(None, [{"rank": 0, "reason": "RuntimeError: peer closed"}],
           processes=[{"rank": 0, "pid": 5}, {"rank": 1, "pid": 6}]), 1, JobState.FAILED,
     "the launcher exited with code 1; rank 0: RuntimeError: peer closed; ranks without a report (killed?): 1 (pid 6)"),
])
def test_outcome(job, exit_code, state, reason):
    got_state, got_reason = outcome(job, exit_code, "last words")
    assert got_state is state
    if reason is None:
        assert got_reason is None
    else:
        assert reason in got_reason
    if state is JobState.FAILED and not job.failures:
        assert got_reason.endswith("last log line: last words")
