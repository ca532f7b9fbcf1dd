"""One real 2-rank job through its whole life on a real server: submitted, a checkpoint requested
mid-run (CHECKPOINTING, then listed with checksums), one rank killed with SIGKILL (FAILED with a
reason, no process left), resumed from that checkpoint (steps continue from its step) to COMPLETED;
then its metrics history, checkpoints, logs, and the 409s of a finished job."""
from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from pathlib import Path

from soak import record

from .helpers import alive, assert_error, job_body, job_pids, job_processes

STEPS = 120  # ~0.1 s a step: long enough to act on the job while it runs
KILL_TO_FAILED_S = 15  # gloo sees the dead peer at once, torchrun tears down, the service polls every 0.25 s


def test_checkpoint_kill_resume_complete(server, tiny_paths):
    http = server.client
    job_id = server.submit(job_body(tiny_paths, ranks=2, steps=STEPS))

    running = server.wait_step(job_id, 3)
    assert running["world_size"] == 2 and len(running["processes"]) == 2
    requested = http.post(f"/v1/training/jobs/{job_id}/checkpoint")
    assert requested.status_code == 200, requested.text
    assert requested.json()["status"] == "CHECKPOINTING"
    checkpoint_id = requested.json()["checkpoint_id"]

    saved = server.wait(job_id, lambda v: (v["metrics"]["last_checkpoint"] or {}).get("checkpoint_id") == checkpoint_id,
                        what="the requested checkpoint")
    checkpoint_step = saved["metrics"]["last_checkpoint"]["step"]
    assert 3 <= checkpoint_step < STEPS
    history = [(h["status"], h["reason"]) for h in saved["history"]]
    asked = history.index(("CHECKPOINTING", f"checkpoint {checkpoint_id} requested"))
    assert ("RUNNING", f"checkpoint {checkpoint_id} complete") in history[asked + 1:]

    # SIGKILL one rank a few steps past the checkpoint: torchrun tears the group down, the job FAILS with a reason
    saved = server.wait_step(job_id, checkpoint_step + 5)
    pids = job_pids(saved)
    killed_at = time.monotonic()
    os.kill(saved["processes"][1]["pid"], signal.SIGKILL)
    failed = server.wait_status(job_id, "FAILED", timeout=120)
    seconds_to_failed = time.monotonic() - killed_at
    assert seconds_to_failed < KILL_TO_FAILED_S, f"FAILED only {seconds_to_failed:.1f} s after the kill"
    assert failed["failure_reason"].startswith("the launcher exited with code "), failed["failure_reason"]
    assert "killed" in failed["failure_reason"]
    assert not [pid for pid in pids if alive(pid)] and not job_processes(job_id)
    first_run = {m["step"]: m["loss"] for m in http.get(f"/v1/training/jobs/{job_id}/metrics").json()["data"]}
    assert_error(http.post(f"/v1/training/jobs/{job_id}/checkpoint"), 409)
    assert_error(http.delete(f"/v1/training/jobs/{job_id}"), 409)
    assert_error(http.post(f"/v1/training/jobs/{job_id}/resume", json={"checkpoint_id": "7d4bd1a1-53d1-4b4f-9ad2-07c1f1cbe6cb"}),
                 404, "checkpoint_id")

    resumed = http.post(f"/v1/training/jobs/{job_id}/resume", json={})  # the newest COMPLETE: the one requested
    assert resumed.status_code == 200, resumed.text
    assert resumed.json() == {"job_id": job_id, "status": "RUNNING"}
    done = server.wait_status(job_id, "COMPLETED", timeout=240)

    assert done["failure_reason"] is None and done["metrics"]["step"] == STEPS
    first, second = done["runs"]
    assert (first["outcome"], second["outcome"]) == ("FAILED", "COMPLETED")
    assert second["resumed_from"] == checkpoint_id and second["start_step"] == checkpoint_step
    assert_metrics_continue(http, job_id, checkpoint_step)
    # the steps the killed run had trained past its checkpoint come out of the resumed run identical
    again = {m["step"]: m["loss"] for m in http.get(f"/v1/training/jobs/{job_id}/metrics").json()["data"]
             if checkpoint_step < m["step"] <= max(first_run)}
    assert again and all(loss == first_run[step] for step, loss in again.items()), (first_run, again)
    record("fault_kill_rank", {"ranks": 2, "killed": "rank 1 (SIGKILL)", "seconds_to_failed": round(seconds_to_failed, 2),
                               "failure_reason": failed["failure_reason"], "processes_left": 0,
                               "resumed_from_step": checkpoint_step, "steps_compared_exactly": len(again)})
    assert_checkpoints_listed(http, job_id, checkpoint_id, checkpoint_step)
    assert_logs(http, job_id)
    assert_error(http.post(f"/v1/training/jobs/{job_id}/resume"), 409)
    assert_error(http.post(f"/v1/training/jobs/{job_id}/checkpoint"), 409)
    statuses = {j["job_id"]: j["status"] for j in http.get("/v1/training/jobs", params={"status": "COMPLETED"}).json()["data"]}
    assert statuses.get(job_id) == "COMPLETED"
    assert job_id not in {j["job_id"] for j in http.get("/v1/training/jobs", params={"status": "RUNNING"}).json()["data"]}


def assert_metrics_continue(http, job_id: str, checkpoint_step: int) -> None:
    """Every step once; the resumed run logged exactly the steps after the checkpoint."""
    records = http.get(f"/v1/training/jobs/{job_id}/metrics").json()["data"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {r["run"] for r in records if r["step"] <= checkpoint_step} == {1}
    assert {r["run"] for r in records if r["step"] > checkpoint_step} == {2}
    assert all(r["loss"] > 0 and r["consumed_tokens"] > 0 for r in records)
    later = http.get(f"/v1/training/jobs/{job_id}/metrics", params={"since_step": STEPS - 2, "limit": 1}).json()["data"]
    assert [r["step"] for r in later] == [STEPS - 1]


def assert_checkpoints_listed(http, job_id: str, checkpoint_id: str, checkpoint_step: int) -> None:
    """Checkpoint records with shard sizes and sha256 checksums that match the files."""
    checkpoints = http.get(f"/v1/training/jobs/{job_id}/checkpoints").json()
    by_id = {c["checkpoint_id"]: c for c in checkpoints}
    mine = by_id[checkpoint_id]
    assert mine["status"] == "COMPLETE" and mine["step"] == checkpoint_step and mine["job_id"] == job_id
    assert mine["metadata"]["global_step"] == checkpoint_step and mine["metadata"]["consumed_tokens"] > 0
    final = max(checkpoints, key=lambda c: c["step"])
    assert final["step"] == STEPS and final["status"] == "COMPLETE"
    for checkpoint in (mine, final):
        ranks = {s["rank"] for s in checkpoint["shards"]}
        assert ranks == {0, 1}, checkpoint["shards"]
        for shard in checkpoint["shards"] + checkpoint["optimizer_states"]:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", shard["checksum"]) and shard["file_size_bytes"] > 0
            data = (Path(checkpoint["path"]) / shard["file_path"]).read_bytes()
            assert len(data) == shard["file_size_bytes"]
            assert "sha256:" + hashlib.sha256(data).hexdigest() == shard["checksum"]


def assert_logs(http, job_id: str) -> None:
    """Offset paging reassembles the log; tail gives its last lines; follow streams a finished job's log and ends."""
    url = f"/v1/training/jobs/{job_id}/logs"
    whole = http.get(url).json()
    assert whole["offset"] == 0 and whole["next_offset"] == whole["size"] > 0
    assert whole["text"].count("==== pagedllm job service: run ") == 2 and "resumed from step" in whole["text"]
    pieces, offset = [], 0
    while True:
        chunk = http.get(url, params={"offset": offset, "limit": 1000}).json()
        if not chunk["text"]:
            break
        pieces.append(chunk["text"])
        offset = chunk["next_offset"]
    assert "".join(pieces) == whole["text"]
    tail = http.get(url, params={"tail": 2}).json()
    assert tail["text"] == "".join(whole["text"].splitlines(keepends=True)[-2:])
    streamed = http.get(url, params={"follow": True, "offset": tail["offset"]})
    assert streamed.headers["content-type"].startswith("text/plain") and streamed.text == tail["text"]
    assert_error(http.get(url, params={"offset": 0, "tail": 1}), 400, "tail")
