"""The SQLite job store: WAL mode, every record kind round-trips and survives reopening."""
from __future__ import annotations

import sqlite3

import pytest

from pagedllm.jobs.records import JobRecord, JobState, RunRecord, Transition
from pagedllm.jobs.store import SQLiteJobStore


def record(job_id: str, seq: int, status: JobState = JobState.PENDING, at: float = 100.0) -> JobRecord:
    return JobRecord(job_id=job_id, job_name=f"job-{job_id}", status=status, queue_seq=seq, world_size=2,
                     config={"checkpoint_config": {"checkpoint_dir": f"/ckpt/{job_id}"}, "optimization_config": {"total_steps": 9}},
                     created_at=at, updated_at=at)


def test_jobs_round_trip_and_survive_reopening(tmp_path):
    store = SQLiteJobStore(tmp_path / "jobs.db")
    assert store.journal_mode == "wal"
    a, b = record("a", 1, at=1.0), record("b", 2, at=2.0)
    store.add(a)
    store.add(b)
    a.status, a.pid, a.pid_create_time, a.cancel_requested = JobState.RUNNING, 4242, 17.5, True
    a.processes = [{"rank": 0, "pid": 4243, "host": "h"}]
    a.failures, a.finish = [{"rank": 1, "reason": "boom", "time": 3.0}], {"reason": "stopped", "step": 4}
    store.save(a, [Transition(JobState.RUNNING, 5.0, "started"), Transition(JobState.CHECKPOINTING, 6.0, None)])
    store.save_run("a", RunRecord(run=1, started_at=5.0))
    store.save_run("a", RunRecord(run=1, started_at=5.0, start_step=0, ended_at=9.0, exit_code=1, outcome="FAILED"))
    store.close()

    store = SQLiteJobStore(tmp_path / "jobs.db")
    assert store.get("a") == a and store.get("b") == b and store.get("zzz") is None
    assert [j.job_id for j in store.jobs()] == ["a", "b"]
    assert [j.job_id for j in store.jobs([JobState.PENDING])] == ["b"]
    assert store.jobs([JobState.COMPLETED, JobState.FAILED]) == []
    assert [(t.status, t.at, t.reason) for t in store.history("a")] == [
        (JobState.PENDING, 1.0, "submitted"), (JobState.RUNNING, 5.0, "started"), (JobState.CHECKPOINTING, 6.0, None)]
    assert store.runs("a") == [RunRecord(run=1, started_at=5.0, start_step=0, ended_at=9.0, exit_code=1, outcome="FAILED")]
    assert store.next_queue_seq() == 3
    with pytest.raises(sqlite3.IntegrityError):
        store.add(record("a", 9))
    store.close()


def test_metrics_history_replaces_relogged_steps(tmp_path):
    store = SQLiteJobStore(tmp_path / "jobs.db")
    store.add(record("a", 1))
    store.add_metrics("a", 1, [{"step": s, "loss": 10.0 - s} for s in range(1, 7)])
    store.drop_metrics_after("a", 4)  # resumed from the step-4 checkpoint
    store.add_metrics("a", 2, [{"step": s, "loss": 1.0} for s in range(5, 9)])
    assert [(m["step"], m["run"]) for m in store.metrics("a")] == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2), (7, 2), (8, 2)]
    assert [m["step"] for m in store.metrics("a", since_step=6)] == [7, 8]
    assert [m["step"] for m in store.metrics("a", since_step=2, limit=2)] == [3, 4]
    assert store.latest_metrics("a") == {"step": 8, "loss": 1.0, "run": 2}
    assert store.latest_metrics("b") is None and store.metrics("b") == []


def test_checkpoint_records_update_in_place(tmp_path):
    store = SQLiteJobStore(tmp_path / "jobs.db")
    store.put_checkpoint("a", {"checkpoint_id": "c2", "step": 20, "status": "SAVING"})
    store.put_checkpoint("a", {"checkpoint_id": "c1", "step": 10, "status": "COMPLETE"})
    store.put_checkpoint("a", {"checkpoint_id": "c2", "step": 20, "status": "COMPLETE", "shards": [1]})
    store.put_checkpoint("b", {"checkpoint_id": "c3", "step": 5, "status": "COMPLETE"})
    assert store.checkpoints("a") == [{"checkpoint_id": "c1", "step": 10, "status": "COMPLETE"},
                                      {"checkpoint_id": "c2", "step": 20, "status": "COMPLETE", "shards": [1]}]


def test_a_newer_schema_is_refused(tmp_path):
    SQLiteJobStore(tmp_path / "jobs.db").close()
    db = sqlite3.connect(tmp_path / "jobs.db")
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(RuntimeError, match="schema 99 is newer"):
        SQLiteJobStore(tmp_path / "jobs.db")
