"""The job store: a small repository interface, and SQLite (WAL) as the embedded default.

Everything the service must remember across restarts goes through `JobStore`: job records, their
state history, their runs, per-step metrics and checkpoint records. A server database (Postgres,
...) can replace SQLite by implementing the same methods; nothing else touches SQL.
"""
from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

from pagedllm.jobs.records import JobRecord, JobState, RunRecord, Transition


class JobStore(ABC):
    """Persistence of the job service. Every method is one atomic change or one consistent read."""

    @abstractmethod
    def add(self, job: JobRecord) -> None: ...

    @abstractmethod
    def get(self, job_id: str) -> JobRecord | None: ...

    @abstractmethod
    def jobs(self, statuses: Iterable[JobState] | None = None) -> list[JobRecord]:
        """Jobs in submission order (created_at), optionally only those in `statuses`."""

    @abstractmethod
    def save(self, job: JobRecord, transitions: Iterable[Transition] = ()) -> None:
        """Write every field of `job`, and record its state changes with it, atomically."""

    @abstractmethod
    def next_queue_seq(self) -> int: ...

    @abstractmethod
    def history(self, job_id: str) -> list[Transition]: ...

    @abstractmethod
    def save_run(self, job_id: str, run: RunRecord) -> None: ...

    @abstractmethod
    def runs(self, job_id: str) -> list[RunRecord]: ...

    @abstractmethod
    def add_metrics(self, job_id: str, run: int, records: list[dict]) -> None:
        """Step records; a step logged again (by a resumed run) replaces the earlier record."""

    @abstractmethod
    def metrics(self, job_id: str, since_step: int = 0, limit: int | None = None) -> list[dict]:
        """Records with step > since_step, in step order, each with its "run"."""

    @abstractmethod
    def latest_metrics(self, job_id: str) -> dict | None: ...

    @abstractmethod
    def drop_metrics_after(self, job_id: str, step: int) -> None: ...

    @abstractmethod
    def put_checkpoint(self, job_id: str, checkpoint: dict) -> None:
        """Insert or update a Checkpoint record (JSON-ready dict) by checkpoint_id."""

    @abstractmethod
    def checkpoints(self, job_id: str) -> list[dict]:
        """The job's checkpoint records, oldest step first."""

    @abstractmethod
    def close(self) -> None: ...


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, job_name TEXT NOT NULL, status TEXT NOT NULL, config TEXT NOT NULL,
    world_size INTEGER NOT NULL, queue_seq INTEGER NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    started_at REAL, finished_at REAL, failure_reason TEXT, run INTEGER NOT NULL, pid INTEGER,
    pid_create_time REAL, events_offset INTEGER NOT NULL, cancel_requested INTEGER NOT NULL,
    requested_checkpoint_id TEXT, resume_from TEXT, exit_code INTEGER, processes TEXT NOT NULL,
    failures TEXT NOT NULL, finish TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, queue_seq);
CREATE TABLE IF NOT EXISTS transitions (
    job_id TEXT NOT NULL, at REAL NOT NULL, status TEXT NOT NULL, reason TEXT
);
CREATE INDEX IF NOT EXISTS transitions_by_job ON transitions (job_id, at);
CREATE TABLE IF NOT EXISTS runs (
    job_id TEXT NOT NULL, run INTEGER NOT NULL, started_at REAL NOT NULL, resumed_from TEXT, start_step INTEGER,
    ended_at REAL, exit_code INTEGER, outcome TEXT, PRIMARY KEY (job_id, run)
);
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, run INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    checkpoint_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, step INTEGER NOT NULL, status TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_by_job ON checkpoints (job_id, step);
"""
SCHEMA_VERSION = 1
JOB_FIELDS = [f.name for f in dataclasses.fields(JobRecord)]
JSON_FIELDS = {"config", "processes", "failures", "finish"}
RUN_FIELDS = [f.name for f in dataclasses.fields(RunRecord)]


class SQLiteJobStore(JobStore):
    """One SQLite file in WAL mode (readers never block the writer; a crash loses no committed row).

    One connection guarded by a lock: the service calls it from the event loop, tests and tools from
    any thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path}: job store schema {version} is newer than this pagedllm ({SCHEMA_VERSION})")
        self._db.executescript(SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @property
    def journal_mode(self) -> str:
        return self._query("PRAGMA journal_mode")[0][0]

    # ---- plumbing ----

    def _query(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _write(self, statements: list[tuple[str, tuple]]) -> None:
        """Several statements in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    self._db.execute(sql, params)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @staticmethod
    def _job_row(job: JobRecord) -> tuple:
        values = []
        for name in JOB_FIELDS:
            value = getattr(job, name)
            if name in JSON_FIELDS:
                value = json.dumps(value)
            elif isinstance(value, JobState):
                value = value.value
            elif isinstance(value, bool):
                value = int(value)
            values.append(value)
        return tuple(values)

    @staticmethod
    def _job_from(row: sqlite3.Row) -> JobRecord:
        data = {name: row[name] for name in JOB_FIELDS}
        for name in JSON_FIELDS:
            data[name] = json.loads(data[name]) if data[name] is not None else None
        data["status"] = JobState(data["status"])
        data["cancel_requested"] = bool(data["cancel_requested"])
        return JobRecord(**data)

    # ---- jobs ----

    def add(self, job: JobRecord) -> None:
        marks = ", ".join("?" for _ in JOB_FIELDS)
        self._write([
            (f"INSERT INTO jobs ({', '.join(JOB_FIELDS)}) VALUES ({marks})", self._job_row(job)),
            ("INSERT INTO transitions VALUES (?, ?, ?, ?)", (job.job_id, job.created_at, job.status.value, "submitted")),
        ])

    def get(self, job_id: str) -> JobRecord | None:
        rows = self._query("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        return self._job_from(rows[0]) if rows else None

    def jobs(self, statuses: Iterable[JobState] | None = None) -> list[JobRecord]:
        if statuses is None:
            rows = self._query("SELECT * FROM jobs ORDER BY created_at, rowid")
        else:
            wanted = [JobState(s).value for s in statuses]
            marks = ", ".join("?" for _ in wanted)
            rows = self._query(f"SELECT * FROM jobs WHERE status IN ({marks}) ORDER BY created_at, rowid", tuple(wanted))
        return [self._job_from(row) for row in rows]

    def save(self, job: JobRecord, transitions: Iterable[Transition] = ()) -> None:
        assignments = ", ".join(f"{name} = ?" for name in JOB_FIELDS if name != "job_id")
        row = self._job_row(job)
        statements = [(f"UPDATE jobs SET {assignments} WHERE job_id = ?", (*row[1:], job.job_id))]
        statements += [("INSERT INTO transitions VALUES (?, ?, ?, ?)", (job.job_id, t.at, t.status.value, t.reason))
                       for t in transitions]
        self._write(statements)

    def next_queue_seq(self) -> int:
        return int(self._query("SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs")[0][0])

    def history(self, job_id: str) -> list[Transition]:
        rows = self._query("SELECT at, status, reason FROM transitions WHERE job_id = ? ORDER BY at, rowid", (job_id,))
        return [Transition(JobState(r["status"]), r["at"], r["reason"]) for r in rows]

    # ---- runs ----

    def save_run(self, job_id: str, run: RunRecord) -> None:
        marks = ", ".join("?" for _ in RUN_FIELDS)
        values = tuple(getattr(run, name) for name in RUN_FIELDS)
        self._write([(f"INSERT OR REPLACE INTO runs (job_id, {', '.join(RUN_FIELDS)}) VALUES (?, {marks})",
                      (job_id, *values))])

    def runs(self, job_id: str) -> list[RunRecord]:
        rows = self._query(f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE job_id = ? ORDER BY run", (job_id,))
        return [RunRecord(**dict(row)) for row in rows]

    # ---- metrics ----

    def add_metrics(self, job_id: str, run: int, records: list[dict]) -> None:
        self._write([("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?)",
                      (job_id, int(r["step"]), run, json.dumps(r))) for r in records])

    def metrics(self, job_id: str, since_step: int = 0, limit: int | None = None) -> list[dict]:
        rows = self._query("SELECT run, record FROM metrics WHERE job_id = ? AND step > ? ORDER BY step LIMIT ?",
                           (job_id, since_step, -1 if limit is None else limit))
        return [{**json.loads(r["record"]), "run": r["run"]} for r in rows]

    def latest_metrics(self, job_id: str) -> dict | None:
        rows = self._query("SELECT run, record FROM metrics WHERE job_id = ? ORDER BY step DESC LIMIT 1", (job_id,))
        return {**json.loads(rows[0]["record"]), "run": rows[0]["run"]} if rows else None

    def drop_metrics_after(self, job_id: str, step: int) -> None:
        self._write([("DELETE FROM metrics WHERE job_id = ? AND step > ?", (job_id, step))])

    # ---- checkpoints ----

    def put_checkpoint(self, job_id: str, checkpoint: dict) -> None:
        self._write([("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                      (str(checkpoint["checkpoint_id"]), job_id, int(checkpoint["step"]), checkpoint["status"],
                       json.dumps(checkpoint)))])

    def checkpoints(self, job_id: str) -> list[dict]:
        rows = self._query("SELECT record FROM checkpoints WHERE job_id = ? ORDER BY step, rowid", (job_id,))
        return [json.loads(r["record"]) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
