"""Slots, server restarts and cancel, with real jobs on a server of its own (2 slots):

a 2-rank job holds both slots, so a 1-rank job submitted after it stays PENDING; the server restarts
mid-job and re-attaches to the running job (same pid, steps keep arriving, history kept); cancelling
the re-attached job leaves no process of it and lets the queued job start; that job's process is
killed while the server is down, and the next server reconciles it as FAILED with the reason."""
from __future__ import annotations

from datetime import datetime

import psutil

from .helpers import alive, assert_error, job_body, job_pids, job_processes

LONG = 100_000  # steps: these jobs end by cancel or kill


def test_queue_restart_and_cancel(fresh_server, tiny_paths):
    srv = fresh_server
    first = srv.submit(job_body(tiny_paths, ranks=2, steps=LONG))
    second = srv.submit(job_body(tiny_paths, ranks=1, steps=LONG))
    running = srv.wait_step(first, 2)
    assert srv.job(second)["status"] == "PENDING"
    assert_cluster(srv, available=0, active=1, pending=1)
    assert_error(srv.client.post(f"/v1/training/jobs/{second}/checkpoint"), 409)
    assert_error(srv.client.post(f"/v1/training/jobs/{first}/resume"), 409)

    # restart mid-job: the job runs on, the new server follows it again
    pids, before = job_pids(running), running["metrics"]["step"]
    srv.stop()
    assert all(alive(pid) for pid in pids), "stopping the server must not stop its jobs"
    srv.start()
    again = srv.job(first)
    assert again["status"] in ("RUNNING", "CHECKPOINTING") and again["pid"] == running["pid"]
    assert again["model_config"] == running["model_config"] and again["history"][:2] == running["history"][:2]
    assert srv.job(second)["status"] == "PENDING"
    srv.wait_step(first, before + 3)
    steps = [r["step"] for r in srv.client.get(f"/v1/training/jobs/{first}/metrics").json()["data"]]
    assert steps[:before] == list(range(1, before + 1))

    # cancel the re-attached job: nothing of it is left, and the queued job starts after it
    cancelled = srv.client.delete(f"/v1/training/jobs/{first}", params={"grace_seconds": 30})
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "CANCELLED"
    assert not [pid for pid in pids if alive(pid)] and not job_processes(first)
    started = srv.wait_status(second, "RUNNING", timeout=30)
    stopped = srv.job(first)
    assert datetime.fromisoformat(started["started_at"]) >= datetime.fromisoformat(stopped["finished_at"])
    [kept] = srv.client.get(f"/v1/training/jobs/{first}/checkpoints").json()  # saved on SIGTERM: resumable
    assert kept["status"] == "COMPLETE" and stopped["history"][-1]["reason"] == f"cancelled by request at step {kept['step']}"
    started = srv.wait_step(second, 2)

    # its process dies while no server watches: the next server reconciles it as FAILED
    srv.stop()
    victims = job_processes(second)
    assert {p.pid for p in victims} >= set(job_pids(started))
    for proc in victims:
        proc.kill()
    psutil.wait_procs(victims, timeout=30)
    srv.start()
    failed = srv.wait_status(second, "FAILED", timeout=30)
    assert "ended while the server was not watching" in failed["failure_reason"]
    assert failed["runs"][-1]["outcome"] == "FAILED" and failed["runs"][-1]["exit_code"] is None
    assert_cluster(srv, available=2, active=0, pending=0)


def assert_cluster(srv, available: int, active: int, pending: int) -> None:
    status = srv.client.get("/v1/cluster/status").json()
    assert status["device_type"] == "cpu" and status["total_gpus"] == 2
    assert (status["available_gpus"], status["active_jobs"], status["pending_jobs"]) == (available, active, pending)
    assert 0 <= status["gpu_utilization"] <= 1 and 0 < status["memory_utilization"] < 1
    [node] = srv.client.get("/v1/cluster/nodes").json()
    assert node["gpus"] == 2 and node["status"] == ("busy" if available == 0 else "ready")
    assert 0 < node["gpu_memory_used"][0] < node["memory_total"][0]
