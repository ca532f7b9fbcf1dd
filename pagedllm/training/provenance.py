"""Which checkpoints this platform wrote: every manifest is signed, and nothing else of a
checkpoint is read before its signature is checked.

Why: a checkpoint holds DCP's `.metadata`, which DCP reads with `pickle.load` — loading it runs
whatever code it names — and every launch of a job resumes from the newest COMPLETE checkpoint in
its checkpoint_dir. A folder someone else can write to (an allowed root shared with other users, a
checkpoint_dir a caller pointed at files they planted) must never reach DCP. So the trainer signs
each manifest with HMAC-SHA256 under a key only the job service (or the user running `pagedllm
train`) holds; the signed manifest names the job and the sha256 of every file DCP will read
(`.metadata` included); and a load checks the signature, then the job, then the checksums, and
only then calls DCP. The RNG states in the manifest are plain data (checkpoint.py), so reading a
manifest never unpickles anything either.

The key: PAGEDLLM_CHECKPOINT_KEY (hex; the job service passes its own to every process it launches),
else the file named by PAGEDLLM_CHECKPOINT_KEY_FILE (`pagedllm export` of a service's checkpoint:
`<data_dir>/.checkpoint-key`), else the user's own, ~/.config/pagedllm/checkpoint-key
(PAGEDLLM_CONFIG_DIR), created with mode 0600 on first use.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.training.config import TrainingJob

KEY_ENV = "PAGEDLLM_CHECKPOINT_KEY"
KEY_FILE_ENV = "PAGEDLLM_CHECKPOINT_KEY_FILE"
KEY_BYTES = 32
SERVICE_KEY_FILE = ".checkpoint-key"


class ProvenanceError(RuntimeError):
    """A checkpoint this job's service did not write (or one written for another job)."""


def key_from_file(path: Path, create: bool = True) -> bytes:
    """The key stored at `path` (hex), made (mode 0600, atomically) if it is missing and `create`."""
    if not path.exists() and create:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(KEY_BYTES))
        try:
            os.link(tmp, path)  # never replaces a key another process made meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return bytes.fromhex(path.read_text().strip())


def service_key(data_dir: Path) -> bytes:
    """The job service's key, kept in its data dir (a hidden file: a dataset folder's files never
    include it, and confinement refuses it as a path), made on first use."""
    return key_from_file(Path(data_dir) / SERVICE_KEY_FILE)


def current_key() -> bytes:
    """This process's signing key (see the module docstring for where it comes from)."""
    if os.environ.get(KEY_ENV):
        return bytes.fromhex(os.environ[KEY_ENV])
    if os.environ.get(KEY_FILE_ENV):
        return key_from_file(Path(os.environ[KEY_FILE_ENV]), create=False)
    config = Path(os.environ.get("PAGEDLLM_CONFIG_DIR") or Path.home() / ".config" / "pagedllm")
    return key_from_file(config / "checkpoint-key")


def sign(payload: bytes, key: bytes) -> str:
    return "hmac-sha256:" + hmac.new(key, payload, hashlib.sha256).hexdigest()


def signed_by(payload: bytes, signature: str | None, key: bytes) -> bool:
    """Whether `signature` is `sign(payload, key)` (compared in constant time)."""
    return signature is not None and hmac.compare_digest(signature, sign(payload, key))


def write_job_file(job: TrainingJob) -> None:
    """<checkpoint_dir>/job.json, replaced whole (a temporary file renamed over it): every rank
    reads it in `continue_job` while rank 0 rewrites it, and a rank that read a half-written file
    took a fresh job_id and then refused the job's own checkpoints as another job's."""
    path = job.checkpoint_dir / "job.json"
    staged = path.with_name(f".job.json.{os.getpid()}")
    staged.write_text(job.model_dump_json(indent=2))
    os.replace(staged, path)


def continue_job(job: TrainingJob) -> TrainingJob:
    """A config that does not name its job_id, run again on the same checkpoint_dir, continues the
    job that wrote it (the id in the folder's job.json): checkpoints are loaded and pruned only by
    the job they were signed for, so a rerun of `pagedllm train --config job.toml` must be that job.
    A config that names its job_id (the job service's always do) is that job, whatever the folder holds."""
    previous = job.checkpoint_dir / "job.json"
    if "job_id" in job.model_fields_set or not previous.is_file():
        return job
    try:
        old = json.loads(previous.read_text()).get("job_id")
        return job.model_copy(update={"job_id": uuid.UUID(old)}) if old else job
    except (OSError, ValueError, AttributeError, TypeError):
        return job  # not a job.json this version wrote: the job keeps its own id (its checkpoints refuse the folder's)
