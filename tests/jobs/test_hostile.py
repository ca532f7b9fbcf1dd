"""Hostile job inputs on a real server (issue 39): each is answered with a 400 naming the field (a full
queue: 429), never a 500; none stalls the event loop; and a row an older version stored with a lone
surrogate does not break the job listing.

One server for the module, with one training slot held by a stand-in job (a shell tagged like a job's
launcher, re-attached from the store at start: no trainer runs) and --max-pending-jobs 1, so a valid
submission waits as PENDING and the next one meets the queue's limit."""
from __future__ import annotations

import json
import math
import threading
import time
import typing
import uuid

import httpx
import pytest
from pydantic import BaseModel
from soak import SOAK, record

from pagedllm.jobs.launcher import ProcessRef
from pagedllm.jobs.records import JobRecord, JobState
from pagedllm.jobs.store import SQLiteJobStore
from pagedllm.training.config import TrainingJob, parse_job

from .helpers import JobServer, assert_error, job_body, no_job_processes_left, stand_in

INT64_MAX = 2**63 - 1
BIG_DATASET_FILES = 10_000  # ~3 s of /health silence before the fix on this machine; under 0.1 s now
OLD_GLOB = "**/*\ud800"  # what an older version accepted and stored (json.dumps escapes it as \\ud800)


def stored_config(paths: dict, job_id: str, checkpoint_dir: str, **sections) -> dict:
    """A job's config as the service stores it (the TrainingJob by alias, checkpoint_dir filled in)."""
    body = {**job_body(paths, ranks=1, steps=3, **sections), "job_id": job_id}
    config = parse_job(body).model_dump(mode="json", by_alias=True, exclude={"status", "created_at", "updated_at"})
    config["checkpoint_config"]["checkpoint_dir"] = checkpoint_dir
    return config


def seed_store(data_dir, paths: dict, launcher: ProcessRef, running_id: str, old_id: str) -> None:
    """The store as an earlier server left it: a job RUNNING (the stand-in) and a FAILED job whose
    file_glob holds a lone surrogate, as versions before the fix accepted."""
    now = time.time()
    running = JobRecord(job_id=running_id, job_name="stand-in", status=JobState.RUNNING, world_size=1, queue_seq=1,
                        created_at=now, updated_at=now, run=1, pid=launcher.pid, pid_create_time=launcher.create_time,
                        config=stored_config(paths, running_id, str(data_dir / "ckpt" / running_id)))
    old_config = stored_config(paths, old_id, str(data_dir / "ckpt" / old_id))
    old_config["data_config"]["file_glob"] = OLD_GLOB
    old = JobRecord(job_id=old_id, job_name="old", status=JobState.FAILED, world_size=1, queue_seq=2,
                    created_at=now, updated_at=now, config=old_config)
    store = SQLiteJobStore(data_dir / "jobs.db")
    try:
        store.add(running)
        store.add(old)
    finally:
        store.close()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_paths):
    """(the server, the stand-in job's id, the old job's id)."""
    root = tmp_path_factory.mktemp("jobs-hostile")
    data_dir = root / "data"
    data_dir.mkdir()
    running_id, old_id = str(uuid.uuid4()), str(uuid.uuid4())
    proc = stand_in(running_id, data_dir, "sleep 600")
    try:
        seed_store(data_dir, tiny_paths, ProcessRef.of(proc.pid), running_id, old_id)
        server = JobServer(data_dir, 1, root, allowed=(tmp_path_factory.getbasetemp(),), extra=("--max-pending-jobs", "1"))
        with no_job_processes_left(data_dir, server.stop):
            try:
                yield server.start(), running_id, old_id
            finally:
                proc.kill()  # the stand-in is ours to end; any other process of a job would fail the check
    finally:
        proc.kill()
        proc.wait()


def post_raw(server: JobServer, text: str, content_type: str = "application/json") -> httpx.Response:
    return server.client.post("/v1/training/jobs", content=text.encode("utf-8"), headers={"Content-Type": content_type})


def job_count(server: JobServer) -> int:
    return len(server.client.get("/v1/training/jobs").json()["data"])


def test_deeply_nested_bodies_are_400(guarded, tiny_paths):
    """A body nested 1,000 deep was a 500 (RecursionError in the JSON parser); 20 deep reached pydantic."""
    server, _, _ = guarded
    before = job_count(server)
    head = json.dumps(job_body(tiny_paths, ranks=1))[:-1]
    for depth in (1000, 20):
        nested = '{"x": ' * depth + "1" + "}" * depth
        assert_error(post_raw(server, f'{head}, "model_config": {nested}}}'), 400, contains="nested")
    assert_error(post_raw(server, "a = " + "[" * 1000 + "]" * 1000, "application/toml"), 400, contains="nested")
    assert job_count(server) == before


@pytest.mark.parametrize("pattern", ["a**", "**a/*", "x/**b", "***", ".", "**/src/**/*.py", "*" * 600])
def test_bad_file_globs_are_400_saying_why(guarded, tiny_paths, pattern):
    """`a**` was a 500 (pathlib's ValueError at the dataset walk); `.` an IndexError."""
    server, _, _ = guarded
    body = job_body(tiny_paths, ranks=1, data_config={"file_glob": pattern})
    assert_error(server.client.post("/v1/training/jobs", json=body), 400, "data_config.file_glob")


@pytest.mark.parametrize("suffix, params, param", [
    ("metrics", {"since_step": 2**63}, "since_step"),
    ("metrics", {"limit": 2**63}, "limit"),
    ("logs", {"offset": 2**63}, "offset"),
    ("logs", {"offset": 2**64, "follow": "true"}, "offset"),
    ("logs", {"tail": 2**63}, "tail"),
])
def test_query_integers_are_bounded_by_int64(guarded, suffix, params, param):
    """since_step=2^63 was a 500 (SQLite's OverflowError); a follow from 2^64 broke off its stream."""
    server, running_id, _ = guarded
    assert_error(server.client.get(f"/v1/training/jobs/{running_id}/{suffix}", params=params), 400, param)


def test_query_integers_at_int64_max_are_served(guarded):
    server, running_id, _ = guarded
    answer = server.client.get(f"/v1/training/jobs/{running_id}/metrics", params={"since_step": INT64_MAX, "limit": INT64_MAX})
    assert answer.status_code == 200 and answer.json()["data"] == []
    logs = server.client.get(f"/v1/training/jobs/{running_id}/logs", params={"offset": INT64_MAX})
    assert logs.status_code == 200 and logs.json()["text"] == ""


@pytest.mark.parametrize("field", ["data_config.file_glob", "job_name", "model_config.key"])
def test_lone_surrogates_are_refused(guarded, tiny_paths, field):
    """A lone surrogate in file_glob was accepted, and every later GET /v1/training/jobs was a 500."""
    server, _, _ = guarded
    before = job_count(server)
    body = job_body(tiny_paths, ranks=1)
    if field == "model_config.key":
        body["model_config"]["MARK"] = 1
    else:
        section, _, name = field.rpartition(".")
        (body[section] if section else body)[name] = "MARK"
    text = json.dumps(body).replace("MARK", "x\\ud800")
    error = assert_error(post_raw(server, text), 400, contains="surrogate")
    assert error["param"].startswith(field.removesuffix(".key"))
    assert job_count(server) == before


def test_a_stored_lone_surrogate_does_not_break_the_listing(guarded):
    """The row an older version stored: listed (its text escaped), and readable on its own."""
    server, _, old_id = guarded
    listing = server.client.get("/v1/training/jobs")
    assert listing.status_code == 200, listing.text
    old = next(job for job in listing.json()["data"] if job["job_id"] == old_id)
    assert old["data_config"]["file_glob"] == "**/*\\ud800"
    assert server.client.get(f"/v1/training/jobs/{old_id}").status_code == 200


def float_fields() -> list[str]:
    """Every float field of the job config, section by section (new fields are covered as they come)."""
    def floats(model: type[BaseModel], prefix: str = "") -> list[str]:
        found = []
        for name, info in model.model_fields.items():
            kinds = typing.get_args(info.annotation) or (info.annotation,)
            if float in kinds:
                found.append(prefix + (info.alias or name))
            elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) and not prefix:
                found += floats(info.annotation, f"{info.alias or name}.")
        return found

    return floats(TrainingJob)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_numbers_are_refused_in_every_float_field(guarded, tiny_paths, value):
    """`learning_rate: Infinity` was accepted (so was every field bounded only from below)."""
    server, _, _ = guarded
    fields = float_fields()
    assert "optimization_config.learning_rate" in fields and len(fields) >= 10
    for field in fields:
        section, _, name = field.rpartition(".")
        body = job_body(tiny_paths, ranks=1)
        (body.setdefault(section, {}) if section else body)[name] = value
        error = assert_error(post_raw(server, json.dumps(body)), 400, field)
        assert "finite" in error["message"], error


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("optimization_config.total_steps", 10**30),
                                          ("optimization_config.warmup_steps", -(2**63) - 1)])
def test_integers_beyond_int64_are_refused(guarded, tiny_paths, field, value):
    server, _, _ = guarded
    section, _, name = field.rpartition(".")
    body = job_body(tiny_paths, ranks=1)
    (body[section] if section else body)[name] = value
    assert_error(server.client.post("/v1/training/jobs", json=body), 400, field, "64-bit")


def test_the_pending_queue_is_bounded(guarded, tiny_paths):
    """No limit before: now past --max-pending-jobs a submission is a 429 (queue_full) until one starts or goes."""
    server, _, _ = guarded
    waiting = server.submit(job_body(tiny_paths, ranks=1, steps=3))  # the stand-in holds the only slot
    try:
        error = assert_error(server.client.post("/v1/training/jobs", json=job_body(tiny_paths, ranks=1)), 429,
                             contains="--max-pending-jobs")
        assert error["code"] == "queue_full"
    finally:
        assert server.client.delete(f"/v1/training/jobs/{waiting}").json()["status"] == "CANCELLED"
    again = server.submit(job_body(tiny_paths, ranks=1, steps=3))
    assert server.client.delete(f"/v1/training/jobs/{again}").json()["status"] == "CANCELLED"


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big-dataset")
    files = SOAK_DATASET_FILES if SOAK else BIG_DATASET_FILES
    for start in range(0, files, 1000):
        sub = folder / f"part{start // 1000:03d}"
        sub.mkdir()
        for i in range(1000):
            (sub / f"f{i}.txt").touch()
    return folder


SOAK_DATASET_FILES = 50_000  # the case: /health stalled 33.5 s


class HealthProbe:
    """/health asked over and over on a thread of its own; the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                began = time.monotonic()
                assert client.get(self.url + "/health").status_code == 200
                self.latencies.append(time.monotonic() - began)
                time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_health_answers_while_a_large_dataset_is_checked(guarded, tiny_paths, big_dataset):
    """The dataset walk of a submission ran on the event loop: every other request waited for it.
    The body fails a cross-field check after the walk (global_batch_size 7), so no job is made."""
    server, _, _ = guarded
    body = job_body(tiny_paths, ranks=1, data_config={"dataset_path": str(big_dataset), "global_batch_size": 7})
    with HealthProbe(server.url) as probe:
        time.sleep(0.1)
        began = time.monotonic()
        answer = server.client.post("/v1/training/jobs", json=body)
        took = time.monotonic() - began
        time.sleep(0.05)
    assert_error(answer, 400, "data_config.global_batch_size")
    slowest = max(probe.latencies)
    # before: the slowest answer waited for the whole check (slowest ~ took). Now a full garbage collection
    # (the walk allocates a Path per file, and it runs with the GIL held) may pause the loop ~0.1-0.2 s.
    assert len(probe.latencies) >= 5 and slowest < max(0.25, took / 2), (slowest, took, len(probe.latencies))
    record("jobs_big_dataset_health", {"files": len(list(big_dataset.iterdir())) * 1000, "submission_s": round(took, 2),
                                       "slowest_health_s": round(slowest, 3), "health_requests": len(probe.latencies)})


@pytest.mark.skipif(not SOAK, reason="make soak: a dataset of 50,000 files, checked at submission and again at launch")
def test_health_answers_while_a_50000_file_job_is_checked_and_launched(server, tiny_paths, big_dataset):
    """The issue's case (/health silent 33.5 s), end to end on the session's server: a valid job over
    50,000 files, its dataset walked at submission and again before launch, both on worker threads."""
    body = job_body(tiny_paths, ranks=1, steps=3, data_config={"dataset_path": str(big_dataset)})
    with HealthProbe(server.url) as probe:
        began = time.monotonic()
        job_id = server.submit(body)
        submitted = time.monotonic() - began
        started = server.wait(job_id, lambda v: v["status"] != "PENDING", timeout=300, what="the launch")
        launched = time.monotonic() - began
    if started["status"] not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert server.client.delete(f"/v1/training/jobs/{job_id}", params={"grace_seconds": 0}).status_code == 200
    slowest = max(probe.latencies)
    record("jobs_50000_files_health", {"files": SOAK_DATASET_FILES, "submission_s": round(submitted, 2),
                                       "until_launched_s": round(launched, 2), "slowest_health_s": round(slowest, 3),
                                       "health_requests": len(probe.latencies)})
    # the slowest answers are full garbage collections of the walk's Path objects (0.33-0.38 s for 50,000
    # files measured in a bare interpreter, 0.48-0.54 s with torch loaded), not the walk itself (33.5 s before)
    assert slowest < 2.0, (slowest, submitted, launched)
