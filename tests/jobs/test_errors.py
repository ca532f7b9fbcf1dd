"""Client errors on the real server, in the server's OpenAI shape: an invalid config is 400 naming the
field (checked before anything starts: no job is created), an unknown job 404 on every route, no API
key 401; and a server without --model serves the training routes."""
from __future__ import annotations

import json
import tomllib
import uuid

import httpx
import pytest

from .helpers import assert_error, job_body, to_toml


def nested(body: dict, path: str, value) -> dict:
    section, _, field = path.partition(".")
    if field:
        body.setdefault(section, {})[field] = value
    else:
        body[section] = value
    return body


@pytest.mark.parametrize("path, value, param", [
    ("bogus_section", {}, "bogus_section"),
    ("model_config.num_layers", 0, "model_config.num_layers"),
    ("model_config.architecture", "gpt5", "model_config.architecture"),
    ("optimization_config.optimizer", "SGD", "optimization_config.optimizer"),
    ("optimization_config.total_steps", "many", "optimization_config.total_steps"),
    ("job_id", str(uuid.uuid4()), "job_id"),
    ("status", "RUNNING", "status"),
    ("parallelism_config.data_parallel_size", 4, "parallelism_config"),  # 4 processes > 2 slots
    ("data_config.global_batch_size", 7, "data_config.global_batch_size"),  # not divisible by 2 x micro 2
    ("model_config.num_kv_heads", 3, "model_config.num_kv_heads"),
    ("data_config.dataset_path", "/nonexistent/corpus", "data_config.dataset_path"),
    ("data_config.tokenizer_path", "/nonexistent/tokenizer", "data_config.tokenizer_path"),
    ("parallelism_config.expert_parallel_size", 2, "parallelism_config.expert_parallel_size"),
    ("job_name", "j" * 10_000, "job_name"),  # issue 28: names had no bound
    ("job_name", "a\nb", "job_name"),
])
def test_invalid_config_is_400_naming_the_field(server, tiny_paths, path, value, param):
    before = len(server.client.get("/v1/training/jobs").json()["data"])
    error = assert_error(server.client.post("/v1/training/jobs", json=nested(job_body(tiny_paths), path, value)), 400, param)
    assert error["message"].startswith(param)
    assert len(server.client.get("/v1/training/jobs").json()["data"]) == before


def test_a_checkpoint_dir_of_another_job_is_refused(server, tiny_paths, tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "someone-else"}))
    body = job_body(tiny_paths, checkpoint_config={"checkpoint_dir": str(tmp_path)})
    assert_error(server.client.post("/v1/training/jobs", json=body), 400, "checkpoint_config.checkpoint_dir", "someone-else")


def test_a_planted_pickle_checkpoint_is_refused_and_never_runs(server, tiny_paths, tmp_path):
    """Issue 28: a job resumed from the newest COMPLETE checkpoint in its checkpoint_dir, whoever
    wrote it, and DCP unpickled its .metadata as the server's user. A folder planted there (checksums
    made consistent, a pickle payload that would create a marker file) fails the job with a message
    naming it; the payload never runs."""
    from pagedllm.training.config import parse_job
    from pagedllm.training.trainer import RunOptions, run_training
    from training.helpers import plant, tiny_job

    made, marker = tmp_path / "made", tmp_path / "payload-ran"
    run_training(parse_job(tiny_job(tiny_paths, made)), RunOptions(peak_flops=1e10, export_hf=False))
    checkpoint_dir = tmp_path / "planted"
    checkpoint_dir.mkdir()
    plant(made / "step-00000006", checkpoint_dir / "step-00000099", marker, pickled_rng=False)
    job_id = server.submit(job_body(tiny_paths, ranks=1, steps=8, checkpoint_config={"checkpoint_dir": str(checkpoint_dir)}))
    view = server.wait(job_id, lambda v: v["status"] in ("FAILED", "COMPLETED"), what="the job to end")
    assert view["status"] == "FAILED" and "refusing to load checkpoint" in view["failure_reason"], view["failure_reason"]
    assert "step-00000099" in view["failure_reason"]
    assert not marker.exists(), "the planted pickle ran"
    assert server.client.get(f"/v1/training/jobs/{job_id}/checkpoints").json() == []  # not listed as the job's


def test_bodies_that_are_not_a_job(server):
    http = server.client
    assert_error(http.post("/v1/training/jobs", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    assert_error(http.post("/v1/training/jobs", json=[1, 2]), 400)
    assert_error(http.post("/v1/training/jobs", json={}), 400, "data_config")
    assert_error(http.get("/v1/training/jobs", params={"status": "SLEEPING"}), 400)
    assert_error(http.post(f"/v1/training/jobs/{uuid.uuid4()}/resume", json={"checkpoint": "x"}), 400)


def test_toml_bodies(server, tiny_paths):
    """A job file posted as TOML goes through the same checks as JSON (the field is named)."""
    toml = {"Content-Type": "application/toml"}
    http = server.client
    before = len(http.get("/v1/training/jobs").json()["data"])
    body = to_toml(nested(job_body(tiny_paths), "model_config.num_layers", 0))
    assert tomllib.loads(body)["model_config"]["num_layers"] == 0
    error = assert_error(http.post("/v1/training/jobs", content=body, headers=toml), 400, "model_config.num_layers")
    assert error["code"] == "invalid_config"
    assert_error(http.post("/v1/training/jobs", content=b"[model_config\nnum_layers = 2", headers=toml), 400,
                 contains="not valid TOML")
    assert_error(http.post("/v1/training/jobs", content=b"\xff\xfe", headers=toml), 400, contains="not valid TOML")
    assert_error(http.post("/v1/training/jobs", content=to_toml(job_body(tiny_paths)),
                           headers={"Content-Type": "application/json"}), 400, contains="not valid JSON")
    assert len(http.get("/v1/training/jobs").json()["data"]) == before


@pytest.mark.parametrize("method, suffix", [
    ("GET", ""), ("DELETE", ""), ("POST", "/checkpoint"), ("GET", "/checkpoints"), ("POST", "/resume"),
    ("GET", "/logs"), ("GET", "/metrics"),
])
def test_unknown_job_is_404(server, method, suffix):
    job_id = str(uuid.uuid4())
    error = assert_error(server.client.request(method, f"/v1/training/jobs/{job_id}{suffix}"), 404, "job_id", job_id)
    assert error["code"] == "not_found"


def test_api_key_required_and_training_served_without_a_model(server):
    for path in ("/v1/training/jobs", "/v1/cluster/status", "/v1/cluster/nodes"):
        assert_error(httpx.get(server.url + path), 401)
        assert server.client.get(path).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.client.get("/v1/models").json()["data"] == []
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/training/jobs", "/v1/training/jobs/{job_id}/resume", "/v1/cluster/status"} <= set(paths)
