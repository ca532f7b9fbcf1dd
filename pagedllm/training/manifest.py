"""The platform's Checkpoint record (manifest.json) and what reads it: writing it signed and
atomically, checking whose it is before anything else of the folder is read, listing and resolving
checkpoint folders, and re-hashing the files it lists.

A manifest is JSON parsed into pydantic records (data only, RNG states as plain numbers); one
that is not what this version writes is refused, never half-read (ProvenanceError). checkpoint.py
saves and loads the state the manifest describes.
"""
from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import uuid
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from pagedllm.training.provenance import ProvenanceError, current_key, sign, signed_by

STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointStatus(str, enum.Enum):
    SAVING = "SAVING"
    COMPLETE = "COMPLETE"
    CORRUPT = "CORRUPT"
    DELETED = "DELETED"


class CheckpointMetadata(BaseModel):
    loss: float | None = None
    learning_rate: float
    global_step: int
    consumed_tokens: int
    elapsed_time_seconds: float


class ShardRecord(BaseModel):
    shard_id: int
    rank: int
    file_path: str  # relative to the checkpoint folder
    file_size_bytes: int
    checksum: str  # "sha256:<hex>"


class OptimizerStateRecord(BaseModel):
    rank: int
    file_path: str
    file_size_bytes: int
    checksum: str


class NumpyRngState(BaseModel):
    """np.random.get_state(): the Mersenne Twister's 624 words and position, and the cached Gaussian."""

    kind: str
    keys: list[int] = Field(min_length=624, max_length=624)
    pos: int
    has_gauss: int
    cached_gaussian: float


class PythonRngState(BaseModel):
    """random.getstate(): the version, the 625 ints of its state and the cached Gaussian."""

    version: int
    state: list[int] = Field(min_length=625, max_length=625)
    gauss_next: float | None = None


class RngStateRecord(BaseModel):
    """Each generator's state as data: torch's (and each CUDA device's) byte state in base64, numpy's
    and Python's as numbers. (Pickled once; a manifest anyone could write then ran code on resume.)"""

    rank: int
    cuda_rng_state: list[str] | None = None
    torch_rng_state: str
    numpy_rng_state: NumpyRngState
    python_rng_state: PythonRngState


class Checkpoint(BaseModel):
    """The platform's Checkpoint record, as written to manifest.json."""

    checkpoint_id: uuid.UUID
    job_id: uuid.UUID
    step: int
    timestamp: datetime
    status: CheckpointStatus
    metadata: CheckpointMetadata
    shards: list[ShardRecord] = Field(default_factory=list)
    optimizer_states: list[OptimizerStateRecord] = Field(default_factory=list)
    rng_states: list[RngStateRecord] = Field(default_factory=list)
    world_size: int = 1
    status_reason: str | None = None
    signature: str | None = None  # provenance.sign() of the rest, under the writer's key
    job_config_checksum: str | None = None  # "sha256:..." of the folder's job.json (None: written before it was kept)

    def payload(self) -> bytes:
        """What the signature covers: the whole record but the signature, so the job id, and the job's
        config by its checksum. A manifest written before the checksum was kept is covered as it was
        signed then (the field left out), so it stays loadable."""
        unsigned = self.model_copy(update={"signature": None})
        exclude = {"job_config_checksum"} if self.job_config_checksum is None else None
        return unsigned.model_dump_json(exclude=exclude).encode()


# ---- manifests on disk -------------------------------------------------------------------------

def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def read_manifest(step_dir: Path) -> Checkpoint | None:
    """The manifest as written (JSON parsed into the record: data only); not yet checked to be ours.
    ProvenanceError if it is not a manifest this version writes (one with pickled RNG states from an
    older pagedllm, or anything else): refused, never half-read."""
    path = step_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        return Checkpoint.model_validate_json(path.read_text())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise ProvenanceError(f"refusing to use checkpoint {step_dir}: its manifest.json is not one this version of pagedllm "
                              f"writes ({where}: {first.get('msg')}); older versions pickled the RNG states, which are "
                              "never unpickled now. Remove the folder or choose another checkpoint_dir") from None


def write_manifest(step_dir: Path, manifest: Checkpoint, key: bytes | None = None) -> None:
    """Signed with `key` (this process's, by default), atomically replaced, so a reader never sees
    half a manifest."""
    signed = manifest.model_copy(update={"signature": sign(manifest.payload(), key or current_key())})
    tmp = step_dir / "manifest.json.tmp"
    tmp.write_text(signed.model_dump_json(indent=2))
    os.replace(tmp, step_dir / "manifest.json")


def authentic(manifest: Checkpoint, key: bytes) -> bool:
    """Whether `key` signed this manifest (the service, or the user, that holds it wrote it)."""
    return signed_by(manifest.payload(), manifest.signature, key)


def check_provenance(step_dir: Path, manifest: Checkpoint, key: bytes, job_id: uuid.UUID | str | None = None) -> None:
    """ProvenanceError unless `key` signed the manifest, for job `job_id` (when given), and the
    folder's job.json is the one it was signed with (its checksum; before checksums were kept: it
    names the same job): the checks before anything else of it is read."""
    refuse = (f"refusing to load checkpoint {step_dir}: it was not written by this job's service ({{}}); a checkpoint's "
              "files include pickles that run code when loaded. Remove the folder or choose another checkpoint_dir")
    if not authentic(manifest, key):
        why = "its manifest is unsigned" if manifest.signature is None else "its manifest's signature is not this service's"
        raise ProvenanceError(refuse.format(why))
    if job_id is not None and str(manifest.job_id) != str(job_id):
        raise ProvenanceError(f"refusing to load checkpoint {step_dir}: it was signed for job {manifest.job_id}, not this "
                              f"job ({job_id}); a job resumes only from its own checkpoints (a copy of another job's "
                              "checkpoint is not one). Remove the folder, or resume the job that wrote it")
    try:
        job_json = (step_dir / "job.json").read_bytes()
        named = json.loads(job_json).get("job_id")
    except (OSError, ValueError, AttributeError):
        job_json, named = None, None
    if manifest.job_config_checksum is not None:
        if job_json is None or sha256_bytes(job_json) != manifest.job_config_checksum:
            raise ProvenanceError(refuse.format("its job.json is not the one its manifest was signed with"))
    elif str(named) != str(manifest.job_id):
        raise ProvenanceError(refuse.format(f"its job.json names job {named}, its manifest job {manifest.job_id}"))


def own_checkpoint(manifest: Checkpoint, key: bytes, job_id: uuid.UUID | str) -> bool:
    """Whether this job wrote the manifest: signed with its key, for its id (what pruning may touch)."""
    return str(manifest.job_id) == str(job_id) and authentic(manifest, key)


def list_checkpoints(checkpoint_dir: Path, skip_unreadable: bool = False) -> list[tuple[Path, Checkpoint]]:
    """Every checkpoint folder with a manifest, oldest step first; a manifest that is not one this
    version writes raises ProvenanceError, or with `skip_unreadable` is left out (the service's
    view: it lists what the job wrote)."""
    found = []
    if checkpoint_dir.is_dir():
        for child in sorted(checkpoint_dir.iterdir()):
            if not STEP_DIR.match(child.name):
                continue
            try:
                manifest = read_manifest(child)
            except ProvenanceError:
                if skip_unreadable:
                    continue
                raise
            if manifest is not None:
                found.append((child, manifest))
    return sorted(found, key=lambda item: item[1].step)


def resolve_checkpoint(ref: str | Path, checkpoint_dir: Path | None = None) -> Path:
    """A checkpoint folder from: its path, a checkpoint_dir (newest COMPLETE in it) or a checkpoint_id."""
    path = Path(ref)
    if (path / "manifest.json").is_file():
        return path
    if path.is_dir():
        complete = [p for p, m in list_checkpoints(path) if m.status is CheckpointStatus.COMPLETE]
        if not complete:
            raise FileNotFoundError(f"no COMPLETE checkpoint in {path}")
        return complete[-1]
    if checkpoint_dir is not None:
        for step_dir, manifest in list_checkpoints(checkpoint_dir):
            if str(manifest.checkpoint_id) == str(ref) or step_dir.name == str(ref):
                return step_dir
    raise FileNotFoundError(f"checkpoint not found: {ref}")


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def verify(step_dir: Path, manifest: Checkpoint, files: list[str] | None = None) -> list[str]:
    """Problems found re-hashing the manifest's files (all, or those named in `files`); [] = intact."""
    problems = []
    for record in [*manifest.shards, *manifest.optimizer_states]:
        if files is not None and record.file_path not in files:
            continue
        path = step_dir / record.file_path
        if not path.is_file():
            problems.append(f"{record.file_path} is missing")
        elif path.stat().st_size != record.file_size_bytes:
            problems.append(f"{record.file_path} has {path.stat().st_size} bytes, manifest says {record.file_size_bytes}")
        elif (actual := sha256_file(path)) != record.checksum:
            problems.append(f"{record.file_path} checksum {actual[:19]}... != manifest {record.checksum[:19]}...")
    return problems


def mark(step_dir: Path, status: CheckpointStatus, reason: str | None = None, key: bytes | None = None) -> Checkpoint:
    manifest = read_manifest(step_dir)
    assert manifest is not None
    manifest = manifest.model_copy(update={"status": status, "status_reason": reason})
    write_manifest(step_dir, manifest, key)
    return manifest
