"""Acceptance: training jobs on a Ray cluster of two nodes on this machine (tests/ray_local.py), driven
through a real `pagedllm serve --cluster ray` over HTTP.

One server for the module. First a 2-rank ZeRO-3 job placed one rank per node (each node has one
CPU): its losses equal the single-process run's, the nodes and the job's ranks show in
/v1/cluster/nodes. Then a longer job whose second node's raylet is killed mid-run: FAILED naming that
node, nothing of it left running, resumed on the remaining node (data_parallel_size 1, the checkpoint
resharded) -> COMPLETED from the checkpoint's step.
"""
from __future__ import annotations

import pytest

from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, run_training
from training.helpers import tiny_job

from .helpers import JobServer, job_body, job_processes, no_job_processes_left

STEPS = 8


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs-ray")
    server = JobServer(root / "data", 1, root, allowed=(tmp_path_factory.getbasetemp(),), extra=("--cluster", "ray"))
    with no_job_processes_left(server.data_dir, server.stop):
        yield server.start()


def single_process_losses(paths: dict, folder, steps: int) -> dict[int, float]:
    job = tiny_job(paths, folder, optimization_config={"total_steps": steps, "warmup_steps": 2},
                   memory_config={"zero_stage": 0})
    return run_training(parse_job(job), RunOptions(peak_flops=1e10, export_hf=False)).losses


def node_view(server: JobServer, node_id: str) -> dict:
    return next(n for n in server.client.get("/v1/cluster/nodes").json() if n["node_id"] == node_id)


def losses_of(server: JobServer, job_id: str) -> dict[int, float]:
    response = server.client.get(f"/v1/training/jobs/{job_id}/metrics")
    assert response.status_code == 200, response.text
    return {m["step"]: m["loss"] for m in response.json()["data"]}


def test_two_rank_zero3_job_one_rank_per_node(ray_server, ray_cluster, tiny_paths, tmp_path):
    status = ray_server.client.get("/v1/cluster/status").json()
    assert status["total_gpus"] == 2 and status["device_type"] == "cpu", status
    job_id = ray_server.submit(job_body(tiny_paths, ranks=2, steps=STEPS, memory_config={"zero_stage": 3}))
    running = ray_server.wait_step(job_id, 1, timeout=120)
    nodes = {p["rank"]: p["node_id"] for p in running["processes"]}
    assert sorted(nodes) == [0, 1] and len(set(nodes.values())) == 2, running["processes"]
    listed = {n["node_id"]: n for n in ray_server.client.get("/v1/cluster/nodes").json()}
    assert {listed[node_id]["address"] for node_id in nodes.values()} == {"127.0.0.1", "127.0.0.2"}, listed
    for rank, node_id in nodes.items():
        assert listed[node_id]["alive"], listed[node_id]
        assert {"job_id": job_id, "ranks": [rank]} in listed[node_id]["jobs"], listed[node_id]
    done = ray_server.wait_status(job_id, "COMPLETED", timeout=180)
    expected = single_process_losses(tiny_paths, tmp_path / "reference", STEPS)
    got = losses_of(ray_server, job_id)
    assert list(got) == list(expected)
    for step, loss in expected.items():  # the mean of two ranks' losses vs of four microbatches: 1 ulp at most
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=0), (step, got[step], loss)
    assert "[rank 0] " in ray_server.client.get(f"/v1/training/jobs/{job_id}/logs").json()["text"]
    assert not job_processes(job_id), done


def test_checkpoint_request_and_cancel(ray_server, tiny_paths):
    job_id = ray_server.submit(job_body(tiny_paths, ranks=2, steps=100000))
    ray_server.wait_step(job_id, 2, timeout=120)
    response = ray_server.client.post(f"/v1/training/jobs/{job_id}/checkpoint")
    assert response.status_code == 200, response.text
    checkpoint_id = response.json()["checkpoint_id"]
    ray_server.wait(job_id, lambda v: (v["metrics"]["last_checkpoint"] or {}).get("checkpoint_id") == checkpoint_id,
                    timeout=60, what="the requested checkpoint")
    response = ray_server.client.delete(f"/v1/training/jobs/{job_id}", params={"grace_seconds": 30})
    assert response.status_code == 200 and response.json()["status"] == "CANCELLED", response.text
    view = ray_server.job(job_id)
    assert "cancelled by request at step" in view["history"][-1]["reason"], view["history"]
    assert not job_processes(job_id)
    checkpoints = ray_server.client.get(f"/v1/training/jobs/{job_id}/checkpoints").json()
    assert len([c for c in checkpoints if c["status"] == "COMPLETE"]) == 2, checkpoints  # requested, and on stop
    status = ray_server.wait(job_id, lambda _: ray_server.client.get("/v1/cluster/status").json()["available_gpus"] == 2,
                             timeout=30, what="both slots free")
    assert status["status"] == "CANCELLED"


def test_node_lost_mid_job_fails_naming_it_then_resumes_on_the_rest(ray_server, ray_cluster, tiny_paths, tmp_path):
    steps = 16
    body = job_body(tiny_paths, ranks=2, steps=steps, memory_config={"zero_stage": 3},
                    checkpoint_config={"checkpoint_interval_steps": 3})
    job_id = ray_server.submit(body)
    try:
        view = ray_server.wait(job_id, lambda v: (v["metrics"]["last_checkpoint"] or {}).get("step", 0) >= 6,
                               timeout=180, what="the checkpoint of step 6")
        second = ray_cluster.second.node_id
        assert second in {p["node_id"] for p in view["processes"]}, view["processes"]
        dead = ray_cluster.kill_second_node()
        failed = ray_server.wait_status(job_id, "FAILED", timeout=60)
        reason = failed["failure_reason"]
        lost_rank = next(p["rank"] for p in view["processes"] if p["node_id"] == dead)
        assert f"node {dead[:12]} (127.0.0.2" in reason and f"rank {lost_rank}" in reason, reason
        assert not job_processes(job_id), reason
        ray_server.wait(job_id, lambda _: not node_view(ray_server, dead)["alive"], timeout=30, what="node dead")
        assert node_view(ray_server, dead)["status"] == "dead"
        assert ray_server.client.get("/v1/cluster/status").json()["total_gpus"] == 1
        refused = ray_server.client.post(f"/v1/training/jobs/{job_id}/resume", json={})
        assert refused.status_code == 409 and "data_parallel_size" in refused.text, refused.text
        checkpoint = max(c["step"] for c in ray_server.client.get(f"/v1/training/jobs/{job_id}/checkpoints").json()
                         if c["status"] == "COMPLETE")
        resumed = ray_server.client.post(f"/v1/training/jobs/{job_id}/resume", json={"data_parallel_size": 1})
        assert resumed.status_code == 200, resumed.text
        try:
            done = ray_server.wait_status(job_id, "COMPLETED", timeout=180)
        except AssertionError as exc:  # what the ranks and the nodes say, for the failure's report
            log = ray_server.client.get(f"/v1/training/jobs/{job_id}/logs", params={"tail": 30}).json()["text"]
            nodes = ray_server.client.get("/v1/cluster/nodes").json()
            raise AssertionError(f"{exc}\nlog:\n{log}\nnodes: {nodes}") from None
    finally:
        ray_cluster.replace_second_node()
    assert done["runs"][-1]["start_step"] == checkpoint and done["world_size"] == 1, done["runs"]
    assert [p["node_id"] for p in done["processes"]] == [ray_cluster.head_id], done["processes"]
    expected = single_process_losses(tiny_paths, tmp_path / "reference", steps)
    got = losses_of(ray_server, job_id)
    assert list(got) == list(expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), (step, got[step], loss)
