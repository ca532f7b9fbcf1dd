"""`pagedllm train --nproc-per-node 2` end to end, as the job service will drive it: torchrun launch, a
checkpoint requested through the trigger file with the requester's id, SIGTERM stopping at a step
boundary with a checkpoint, then `--resume-from <checkpoint_id>` reproducing the logged losses exactly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pagedllm.training.progress import read_metrics

from .helpers import tiny_job

REQUESTED_ID = "0badc0de-0000-4000-8000-000000000001"


def read_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, events_file: Path, proc: subprocess.Popen, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in read_events(events_file):
            if predicate(event):
                return event
        assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError("timed out waiting for an event")


def train(config: Path, *extra: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.training.cli", "train", "--config", str(config), "--nproc-per-node", "2",
           "--peak-flops", "1e10", *extra]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_checkpoint_request_sigterm_and_exact_resume_by_id(tiny_paths, tmp_path):
    ckpt = tmp_path / "run"
    job = tiny_job(tiny_paths, ckpt, memory_config={"zero_stage": 3},
                   optimization_config={"total_steps": 1_000_000, "lr_scheduler": "CONSTANT"})
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    events_file = ckpt / "events.jsonl"

    proc = train(config, log=tmp_path / "first.log")
    try:
        started = wait_for(lambda e: e["event"] == "started", events_file, proc)
        wait_for(lambda e: e["event"] == "step" and e["step"] >= 3, events_file, proc)
        (ckpt / "control").mkdir(exist_ok=True)
        request = ckpt / "control" / "request.tmp"
        request.write_text(json.dumps({"checkpoint_id": REQUESTED_ID}))
        request.rename(ckpt / "control" / "checkpoint.request")  # atomic, as documented
        done = wait_for(lambda e: e["event"] == "checkpoint" and e["status"] == "COMPLETE"
                        and e["checkpoint_id"] == REQUESTED_ID, events_file, proc)
        requested_step = done["step"]
        wait_for(lambda e: e["event"] == "step" and e["step"] >= requested_step + 3, events_file, proc)
        proc.send_signal(signal.SIGTERM)  # to torchrun: the launcher exec'd into it
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0  # torchrun reports the signal; the events say how the workers ended
    events = read_events(events_file)
    finished = [e for e in events if e["event"] == "finished"]
    assert finished[-1]["reason"] == "stopped" and finished[-1]["exit_code"] == 128 + signal.SIGTERM
    stop_step = finished[-1]["step"]
    assert any(e["event"] == "checkpoint" and e["status"] == "COMPLETE" and e["step"] == stop_step for e in events)
    manifest = json.loads((ckpt / f"step-{requested_step:08d}" / "manifest.json").read_text())
    assert manifest["checkpoint_id"] == REQUESTED_ID and manifest["status"] == "COMPLETE"
    assert {s["rank"] for s in manifest["shards"]} == {0, 1} and all(s["checksum"].startswith("sha256:") for s in manifest["shards"])
    assert [r["rank"] for r in manifest["rng_states"]] == [0, 1]
    assert all(not pid_alive(p["pid"]) for p in started["processes"])
    first = {r["step"]: r["loss"] for r in read_metrics(ckpt / "metrics.jsonl")}

    resumed = train(config, "--resume-from", REQUESTED_ID, "--stop-at-step", str(stop_step), log=tmp_path / "second.log")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    second_start = [e for e in read_events(events_file) if e["event"] == "started"][-1]
    assert second_start["step"] == requested_step and second_start["resumed_from"] == REQUESTED_ID
    assert second_start["job_id"] == started["job_id"]  # same checkpoint_dir, same job
    again = {r["step"]: r["loss"] for r in read_metrics(ckpt / "metrics.jsonl")}
    assert sorted(again) == list(range(1, stop_step + 1))
    for step in range(requested_step + 1, stop_step + 1):
        assert again[step] == first[step], f"step {step}: resumed {again[step]} != first run {first[step]}"
