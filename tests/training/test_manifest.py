"""The Checkpoint manifest (pagedllm/training/manifest.py) without a training run: what is signed,
what a reader refuses and why, listing and resolving folders, and re-hashing the files a manifest
lists. Milliseconds each; `make mutate` runs them against the module's mutants (the training runs
in test_checkpoint*.py cover the same code end to end)."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import pytest

from pagedllm.training.manifest import (Checkpoint, CheckpointMetadata, CheckpointStatus, OptimizerStateRecord,
                                        ShardRecord, authentic, check_provenance, list_checkpoints, mark, own_checkpoint,
                                        read_manifest, resolve_checkpoint, sha256_bytes, sha256_file, step_dir_name, verify,
                                        write_manifest)
from pagedllm.training.provenance import ProvenanceError

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
JOB = uuid.UUID("00000000-0000-0000-0000-000000000001")


def manifest(step: int = 2, status: CheckpointStatus = CheckpointStatus.COMPLETE, job_json: bytes | None = None, **fields) -> Checkpoint:
    return Checkpoint(checkpoint_id=uuid.UUID(int=step), job_id=JOB, step=step, timestamp=datetime(2026, 1, 1, tzinfo=timezone.utc),
                      status=status, metadata=CheckpointMetadata(learning_rate=1e-3, global_step=step, consumed_tokens=8 * step,
                                                                 elapsed_time_seconds=1.0),
                      job_config_checksum=sha256_bytes(job_json) if job_json is not None else None, **fields)


def checkpoint_folder(root, step: int = 2, status: CheckpointStatus = CheckpointStatus.COMPLETE, key: bytes = KEY,
                      files: dict[str, bytes] | None = None, job_json: bytes | None = None):
    """A step folder with its job.json, the given files and a signed manifest listing them (model/ files as
    shards, optim/ files as optimizer states)."""
    folder = root / step_dir_name(step)
    folder.mkdir(parents=True)
    job_json = job_json if job_json is not None else json.dumps({"job_id": str(JOB)}).encode()
    (folder / "job.json").write_bytes(job_json)
    shards, optim = [], []
    for index, (name, data) in enumerate((files or {}).items()):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        common = dict(rank=0, file_path=name, file_size_bytes=len(data), checksum=sha256_bytes(data))
        (shards.append(ShardRecord(shard_id=index, **common)) if name.startswith("model/")
         else optim.append(OptimizerStateRecord(**common)))
    write_manifest(folder, manifest(step, status, job_json, shards=shards, optimizer_states=optim), key)
    return folder


def test_step_folders_and_hashes():
    assert step_dir_name(42) == "step-00000042" and step_dir_name(123456789) == "step-123456789"
    assert sha256_bytes(b"abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_sha256_file_reads_in_blocks(tmp_path):
    data = bytes(range(256)) * 8193  # over two 1 MiB blocks
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == sha256_bytes(data)


def test_a_written_manifest_reads_back_signed_and_replaced_atomically(tmp_path):
    folder = checkpoint_folder(tmp_path)
    read = read_manifest(folder)
    assert read.step == 2 and read.status is CheckpointStatus.COMPLETE and read.signature
    assert authentic(read, KEY) and not authentic(read, OTHER_KEY)
    assert not (folder / "manifest.json.tmp").exists()
    assert json.loads((folder / "manifest.json").read_text())["step"] == 2
    assert (folder / "manifest.json").read_text().startswith('{\n  "checkpoint_id"')  # indented, as people read it


def test_the_signature_covers_the_whole_record(tmp_path):
    """Changing any field (the step, the job, the config checksum, the status) breaks it."""
    read = read_manifest(checkpoint_folder(tmp_path))
    for change in ({"step": 3}, {"job_id": uuid.uuid4()}, {"job_config_checksum": sha256_bytes(b"x")},
                   {"status": CheckpointStatus.DELETED}):
        assert not authentic(read.model_copy(update=change), KEY), change
    assert authentic(read.model_copy(update={"signature": read.signature}), KEY)
    assert read.payload() == read.model_copy(update={"signature": "other"}).payload()


def test_a_manifest_signed_before_the_checksum_was_kept_stays_loadable(tmp_path):
    """Its payload leaves the field out, as it was signed then; a manifest with it covers it."""
    old = manifest(job_json=None)
    assert b"job_config_checksum" not in old.payload()
    assert b"job_config_checksum" in manifest(job_json=b"{}").payload()
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "job.json").write_text(json.dumps({"job_id": str(JOB)}))
    write_manifest(folder, old, KEY)
    check_provenance(folder, read_manifest(folder), KEY, JOB)
    (folder / "job.json").write_text(json.dumps({"job_id": str(uuid.uuid4())}))
    with pytest.raises(ProvenanceError, match=f"its job.json names job .*, its manifest job {JOB}"):
        check_provenance(folder, read_manifest(folder), KEY)
    (folder / "job.json").write_text("[1]")  # not an object: names no job
    with pytest.raises(ProvenanceError, match=f"its job.json names job None, its manifest job {JOB}"):
        check_provenance(folder, read_manifest(folder), KEY)


def test_read_manifest_refuses_what_this_version_does_not_write(tmp_path):
    assert read_manifest(tmp_path) is None  # no manifest: not a checkpoint
    folder = checkpoint_folder(tmp_path)
    data = json.loads((folder / "manifest.json").read_text())
    data["rng_states"] = [{"rank": 0, "torch_rng_state": "x", "numpy_rng_state": "pickled", "python_rng_state": {}}]
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ProvenanceError, match=r"refusing to use checkpoint .*step-00000002: its manifest.json is not one "
                                              r"this version of pagedllm writes \(rng_states\.0\.numpy_rng_state: Input should be an "
                                              r"object\); older "
                                              r"versions pickled the RNG states, which are never unpickled now\. Remove the "
                                              r"folder or choose another checkpoint_dir$"):
        read_manifest(folder)


def test_check_provenance_refuses_unsigned_foreign_and_swapped_folders(tmp_path):
    folder = checkpoint_folder(tmp_path)
    check_provenance(folder, read_manifest(folder), KEY, JOB)
    check_provenance(folder, read_manifest(folder), KEY, str(JOB))
    check_provenance(folder, read_manifest(folder), KEY)  # any job
    unsigned = read_manifest(folder).model_copy(update={"signature": None})
    with pytest.raises(ProvenanceError, match=r"^refusing to load checkpoint .*: it was not written by this job's service "
                                              r"\(its manifest is unsigned\); a checkpoint's files include pickles that run code "
                                              r"when loaded\. Remove the folder or choose another checkpoint_dir$"):
        check_provenance(folder, unsigned, KEY)
    with pytest.raises(ProvenanceError, match=r"\(its manifest's signature is not this service's\)"):
        check_provenance(folder, read_manifest(folder), OTHER_KEY)
    other_job = uuid.uuid4()
    with pytest.raises(ProvenanceError, match=f"it was signed for job {JOB}, not this job \\({other_job}\\); a job resumes "
                                              r"only from its own checkpoints \(a copy of another job's checkpoint is not one\)\. "
                                              "Remove the folder, or resume the job that wrote it$"):
        check_provenance(folder, read_manifest(folder), KEY, other_job)
    (folder / "job.json").write_text(json.dumps({"job_id": str(JOB), "changed": True}))
    with pytest.raises(ProvenanceError, match=r"\(its job.json is not the one its manifest was signed with\)"):
        check_provenance(folder, read_manifest(folder), KEY, JOB)
    (folder / "job.json").unlink()
    with pytest.raises(ProvenanceError, match=r"\(its job.json is not the one its manifest was signed with\)"):
        check_provenance(folder, read_manifest(folder), KEY, JOB)


def test_own_checkpoint_needs_the_key_and_the_job(tmp_path):
    read = read_manifest(checkpoint_folder(tmp_path))
    assert own_checkpoint(read, KEY, JOB) and own_checkpoint(read, KEY, str(JOB))
    assert not own_checkpoint(read, OTHER_KEY, JOB) and not own_checkpoint(read, KEY, uuid.uuid4())


def test_list_checkpoints_orders_by_step_and_skips_what_is_not_a_step_folder(tmp_path):
    assert list_checkpoints(tmp_path / "missing") == []
    for step in (10, 2, 9):
        checkpoint_folder(tmp_path, step)
    (tmp_path / "step-7").mkdir()  # not 8 digits
    (tmp_path / "step-00000003").mkdir()  # no manifest
    (tmp_path / "notes-00000004").mkdir()
    assert [m.step for _, m in list_checkpoints(tmp_path)] == [2, 9, 10]
    assert [p.name for p, _ in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000009", "step-00000010"]
    misnamed = checkpoint_folder(tmp_path / "other", 50)  # a folder whose name says 5, its manifest 50
    misnamed.rename(tmp_path / "step-00000005")
    assert [m.step for _, m in list_checkpoints(tmp_path)] == [2, 9, 10, 50]
    (tmp_path / "step-00000006").mkdir()
    (tmp_path / "step-00000006" / "manifest.json").write_text('{"step": 6}')
    with pytest.raises(ProvenanceError, match="step-00000006"):
        list_checkpoints(tmp_path)
    assert [m.step for _, m in list_checkpoints(tmp_path, skip_unreadable=True)] == [2, 9, 10, 50]


def test_resolve_checkpoint_from_a_folder_a_directory_or_an_id(tmp_path):
    two = checkpoint_folder(tmp_path, 2)
    checkpoint_folder(tmp_path, 5)
    nine = checkpoint_folder(tmp_path, 9)
    checkpoint_folder(tmp_path, 12, status=CheckpointStatus.CORRUPT)
    assert resolve_checkpoint(two) == two
    assert resolve_checkpoint(str(tmp_path)) == nine  # the newest COMPLETE one
    assert resolve_checkpoint(str(uuid.UUID(int=2)), tmp_path) == two
    assert resolve_checkpoint("step-00000009", tmp_path) == nine
    with pytest.raises(FileNotFoundError, match="^checkpoint not found: nowhere$"):
        resolve_checkpoint("nowhere", tmp_path)
    with pytest.raises(FileNotFoundError, match="^checkpoint not found: nowhere$"):
        resolve_checkpoint("nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"^no COMPLETE checkpoint in {empty}$"):
        resolve_checkpoint(empty)


def test_verify_names_each_missing_resized_or_changed_file(tmp_path):
    folder = checkpoint_folder(tmp_path, files={"model/a.distcp": b"aaaa", "model/.metadata": b"m", "optim/b.distcp": b"bb",
                                                "optim/c.distcp": b"cc"})
    read = read_manifest(folder)
    assert [s.shard_id for s in read.shards] == [0, 1] and len(read.optimizer_states) == 2
    assert verify(folder, read) == []
    (folder / "model" / "a.distcp").write_bytes(b"aaaaa")
    (folder / "optim" / "b.distcp").write_bytes(b"bx")
    (folder / "optim" / "c.distcp").unlink()
    assert verify(folder, read) == [
        "model/a.distcp has 5 bytes, manifest says 4",
        f"optim/b.distcp checksum {sha256_bytes(b'bx')[:19]}... != manifest {sha256_bytes(b'bb')[:19]}...",
        "optim/c.distcp is missing",
    ]
    assert verify(folder, read, files=["model/.metadata", "optim/b.distcp"]) == [verify(folder, read)[1]]
    assert verify(folder, read, files=[]) == []


def test_mark_changes_the_status_and_keeps_the_signature_valid(tmp_path):
    folder = checkpoint_folder(tmp_path, status=CheckpointStatus.SAVING)
    marked = mark(folder, CheckpointStatus.CORRUPT, "checksum mismatch", KEY)
    assert (marked.status, marked.status_reason) == (CheckpointStatus.CORRUPT, "checksum mismatch")
    read = read_manifest(folder)
    assert (read.status, read.status_reason, read.step) == (CheckpointStatus.CORRUPT, "checksum mismatch", 2)
    assert authentic(read, KEY)
    assert mark(folder, CheckpointStatus.DELETED, key=KEY).status_reason is None
    assert [s.value for s in CheckpointStatus] == ["SAVING", "COMPLETE", "CORRUPT", "DELETED"]
