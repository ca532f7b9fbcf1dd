"""Checkpoints are bound to the job that wrote them (issue 39): a job resumed from another job's signed
checkpoint copied into its folder, and its pruning then deleted that copy's shards. Now the signed
manifest names the job (its id, and its job.json by checksum); a resume refuses a checkpoint signed
for another job, naming it; pruning touches only the job's own checkpoints; and a manifest written
before the checksum was kept still loads."""
from __future__ import annotations

import json
import shutil
import uuid

import pytest

from pagedllm.training.checkpoint import (
    CheckpointStatus,
    authentic,
    check_provenance,
    list_checkpoints,
    read_manifest,
    verify,
    write_manifest,
)
from pagedllm.training.provenance import ProvenanceError, current_key

from .test_checkpoint import run, statuses


@pytest.fixture(scope="module")
def two_jobs(tiny_paths, tmp_path_factory):
    """Job A's checkpoint folder (step 2) and job B's (steps 1 and 2), both signed with this user's key."""
    root = tmp_path_factory.mktemp("two-jobs")
    run(tiny_paths, root / "a", optimization_config={"total_steps": 2, "warmup_steps": 1})
    run(tiny_paths, root / "b", optimization_config={"total_steps": 2, "warmup_steps": 1},
        checkpoint_config={"checkpoint_interval_steps": 1})
    return root / "a", root / "b"


def job_id_of(folder) -> str:
    return json.loads((folder / "job.json").read_text())["job_id"]


def test_a_copy_of_another_jobs_checkpoint_is_refused_and_never_pruned(tiny_paths, two_jobs, tmp_path):
    a, original_b = two_jobs
    b = tmp_path / "b"
    shutil.copytree(original_b, b)
    copy = b / "step-00000099"
    shutil.copytree(a / "step-00000002", copy)  # the newest checkpoint of b's folder now: a's, as it was signed
    longer = {"total_steps": 4, "warmup_steps": 1}
    with pytest.raises(ProvenanceError, match=f"step-00000099: it was signed for job {job_id_of(a)}, not this job "
                                              f"\\({job_id_of(b)}\\)"):
        run(tiny_paths, b, optimization_config=longer)
    assert read_manifest(copy).status is CheckpointStatus.COMPLETE

    # older than b's own: b resumes from its own step 2, keeps 1, and prunes its own only
    shutil.move(copy, b / "step-00000000")
    resumed = run(tiny_paths, b, optimization_config=longer, checkpoint_config={"max_checkpoints_to_keep": 1})
    assert resumed.start_step == 2 and resumed.final_step == 4
    copied = read_manifest(b / "step-00000000")
    assert str(copied.job_id) == job_id_of(a) and copied.status is CheckpointStatus.COMPLETE
    assert verify(b / "step-00000000", copied) == []  # every shard of the copy is still there
    own = {m.step: m.status.value for p, m in list_checkpoints(b) if p.name != "step-00000000"}
    assert own == {1: "DELETED", 2: "DELETED", 4: "COMPLETE"}, statuses(b)


def test_the_signature_covers_the_job_id_and_its_config(two_jobs, tmp_path):
    a, _ = two_jobs
    step_dir = tmp_path / "step"
    shutil.copytree(a / "step-00000002", step_dir)
    manifest, key = read_manifest(step_dir), current_key()
    check_provenance(step_dir, manifest, key, job_id_of(a))
    assert manifest.job_config_checksum.startswith("sha256:")
    assert not authentic(manifest.model_copy(update={"job_id": uuid.uuid4()}), key)
    assert not authentic(manifest.model_copy(update={"job_config_checksum": "sha256:" + "0" * 64}), key)
    job = json.loads((step_dir / "job.json").read_text())
    (step_dir / "job.json").write_text(json.dumps({**job, "model_config": {**job["model_config"], "num_layers": 3}}))
    with pytest.raises(ProvenanceError, match="its job.json is not the one its manifest was signed with"):
        check_provenance(step_dir, manifest, key)


def test_a_manifest_signed_before_the_config_checksum_still_loads(two_jobs, tmp_path):
    """Written by the version before (no job_config_checksum in what it signed): loadable by its own
    job, whose id its job.json must still name; refused for any other job."""
    a, _ = two_jobs
    step_dir = tmp_path / "step"
    shutil.copytree(a / "step-00000002", step_dir)
    old = read_manifest(step_dir).model_copy(update={"job_config_checksum": None})
    write_manifest(step_dir, old)
    assert '"job_config_checksum"' not in old.payload().decode()  # exactly what the earlier version signed
    manifest, key = read_manifest(step_dir), current_key()
    check_provenance(step_dir, manifest, key, job_id_of(a))
    with pytest.raises(ProvenanceError, match="signed for job"):
        check_provenance(step_dir, manifest, key, uuid.uuid4())
    (step_dir / "job.json").write_text(json.dumps({"job_id": str(uuid.uuid4())}))
    with pytest.raises(ProvenanceError, match="its job.json names job"):
        check_provenance(step_dir, manifest, key)


def test_job_json_is_replaced_whole_so_a_rank_reading_it_sees_one_job_id(tiny_paths, tmp_path):
    """Rank 0 rewrites job.json while the other ranks read it (continue_job): a reader of the old
    file keeps its whole content, and the new one is complete — never a half-written file, from
    which a rank would take a fresh job_id and refuse the job's own checkpoints."""
    from pagedllm.training.config import parse_job
    from pagedllm.training.provenance import continue_job, write_job_file

    from .helpers import tiny_job

    job = parse_job(tiny_job(tiny_paths, tmp_path / "ckpt"))
    job.checkpoint_dir.mkdir(parents=True)
    write_job_file(job)
    with open(job.checkpoint_dir / "job.json") as reader:
        write_job_file(job.model_copy(update={"job_name": "renamed"}))
        assert json.loads(reader.read())["job_name"] == job.job_name  # the old file, whole
    assert json.loads((job.checkpoint_dir / "job.json").read_text())["job_name"] == "renamed"
    assert [p.name for p in job.checkpoint_dir.iterdir()] == ["job.json"]  # no staged file left
    assert continue_job(parse_job(tiny_job(tiny_paths, tmp_path / "ckpt"))).job_id == job.job_id
