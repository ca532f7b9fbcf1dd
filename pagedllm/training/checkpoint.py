"""Sharded checkpoints with torch.distributed.checkpoint (DCP) and the platform's Checkpoint manifest.

Layout of one checkpoint, `<checkpoint_dir>/step-00000042/`:

    manifest.json   the Checkpoint record: id, job, step, status, metadata, shards, RNG states
    job.json        the resolved TrainingJob (export rebuilds the model from it)
    model/          DCP: one __<rank>_<n>.distcp file per rank + .metadata   -> manifest "shards"
    optim/          DCP: optimizer state (and the FP16 grad scaler)          -> "optimizer_states"

Status goes SAVING (written before any shard) -> COMPLETE (after every rank's files are on disk and
hashed). Resume verifies the sha256 of every file first: a mismatch marks the checkpoint CORRUPT and
the next newest COMPLETE one is tried (the record and its checks: manifest.py). A save that fails (a full disk: ENOSPC) removes its partial
files, is marked CORRUPT with the cause, and raises CheckpointSaveError naming it; the checkpoints
saved before it are untouched (pruning runs only after a save is COMPLETE). Keeping
max_checkpoints_to_keep, older COMPLETE checkpoints lose their data and become DELETED (the manifest
stays, as a record).

With async_save, DCP stages the state to memory and writes from a background thread over a separate
gloo group; training goes on, and at each step boundary the ranks agree (one all-reduce) on whether
every rank's write has finished, and only then hash and mark COMPLETE.

Nothing a caller could place is unpickled: the manifest is JSON with the RNG states as plain numbers,
and it is signed (provenance.py); a load checks the signature and the job before it re-hashes the
files, and re-hashes them before DCP (whose `.metadata` is a pickle) reads any. A checkpoint folder
this job's service did not write is refused with ProvenanceError, naming it.
"""
from __future__ import annotations

import base64
import logging
import random
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch import nn

from pagedllm.training.config import CheckpointConfig
from pagedllm.training.manifest import (  # noqa: F401 (re-exported: the manifest is part of the checkpoint API)
    STEP_DIR,
    Checkpoint,
    CheckpointMetadata,
    CheckpointStatus,
    NumpyRngState,
    OptimizerStateRecord,
    PythonRngState,
    RngStateRecord,
    ShardRecord,
    authentic,
    check_provenance,
    list_checkpoints,
    mark,
    own_checkpoint,
    read_manifest,
    resolve_checkpoint,
    sha256_bytes,
    sha256_file,
    step_dir_name,
    verify,
    write_manifest,
)
from pagedllm.training.provenance import ProvenanceError, current_key  # noqa: F401 (ProvenanceError: re-exported)

log = logging.getLogger("pagedllm.training")

RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the message names the cause and the newest COMPLETE checkpoint left."""


def root_cause(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (which gathers every rank's failure)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first, _ = exc.failures[min(exc.failures)]
        return root_cause(first)
    return exc


# ---- RNG states --------------------------------------------------------------------------------

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes_state(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8)


def capture_rng(rank: int) -> RngStateRecord:
    cuda = [_b64(state.numpy().tobytes()) for state in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return RngStateRecord(
        rank=rank,
        cuda_rng_state=cuda,
        torch_rng_state=_b64(torch.get_rng_state().numpy().tobytes()),
        numpy_rng_state=NumpyRngState(kind=kind, keys=keys.tolist(), pos=pos, has_gauss=has_gauss, cached_gaussian=cached),
        python_rng_state=PythonRngState(version=version, state=list(state), gauss_next=gauss_next),
    )


def restore_rng(record: RngStateRecord) -> None:
    torch.set_rng_state(_bytes_state(record.torch_rng_state))
    state = record.numpy_rng_state
    np.random.set_state((state.kind, np.array(state.keys, dtype=np.uint32), state.pos, state.has_gauss, state.cached_gaussian))
    python = record.python_rng_state
    random.setstate((python.version, tuple(python.state), python.gauss_next))
    if record.cuda_rng_state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_state(encoded) for encoded in record.cuda_rng_state])


# ---- state dicts of (possibly several) model parts -----------------------------------------------

# Frozen parameters (a LoRA job's base) are not saved: the base model is read again from its file
# at resume, so a LoRA checkpoint holds only the adapter and its optimizer state.
TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def model_state(parts: list[nn.Module]) -> dict:
    state: dict = {}
    for part in parts:
        # a tied weight's second name (lm_head.weight) escapes ignore_frozen_params: drop it by name
        frozen = {name for name, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state.update({k: v for k, v in get_model_state_dict(part, options=TRAINABLE).items() if k not in frozen})
    return state


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """Flattened (FQN-keyed) so pipeline stages' states merge into one checkpoint and reshard freely."""
    state: dict = {}
    for part, optimizer in zip(parts, optimizers):
        state.update(get_optimizer_state_dict(part, optimizer, options=FLAT))
    return state


# ---- the manager --------------------------------------------------------------------------------

@dataclass
class _Pending:
    step_dir: Path
    manifest: Checkpoint
    futures: list = field(default_factory=list)
    rng: RngStateRecord | None = None


class CheckpointManager:
    """Saves, finalises, prunes and loads checkpoints of one job; every method is collective."""

    def __init__(self, config: CheckpointConfig, job_id: uuid.UUID, job_json: str, parts: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], extra_state: Callable[[], dict] | None = None,
                 load_extra_state: Callable[[dict], None] | None = None,
                 on_event: Callable[..., None] | None = None) -> None:
        """`job_json`: the resolved job, written into every checkpoint (export rebuilds the model from it)."""
        self.config, self.job_id, self.job_json = config, job_id, job_json
        self.dir = Path(config.checkpoint_dir)
        self.parts, self.optimizers = parts, optimizers
        self.extra_state = extra_state or dict
        self.load_extra_state = load_extra_state or (lambda state: None)
        self.on_event = on_event or (lambda *args, **kwargs: None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.key = current_key()  # signs this job's manifests; a manifest not signed with it is never loaded
        # Async writes run collectives from a background thread: give them their own group.
        self.async_group = dist.new_group(backend="gloo") if config.async_save else None
        self.pending: _Pending | None = None

    # -- saving --

    def save(self, step: int, metadata: CheckpointMetadata, checkpoint_id: uuid.UUID | None = None,
             blocking: bool = False) -> uuid.UUID:
        """Start a checkpoint of the current state; with async_save (and not `blocking`) return at once.
        A failed write raises CheckpointSaveError (after removing the partial files)."""
        self.wait()
        step_dir = self.dir / step_dir_name(step)
        try:
            return self._save(step, step_dir, metadata, checkpoint_id, blocking)
        except (Exception, CheckpointException) as exc:
            raise self._save_failed(step, step_dir, exc) from exc

    def _save(self, step: int, step_dir: Path, metadata: CheckpointMetadata, checkpoint_id: uuid.UUID | None,
              blocking: bool) -> uuid.UUID:
        manifest = Checkpoint(checkpoint_id=checkpoint_id or uuid.uuid4(), job_id=self.job_id, step=step,
                              timestamp=datetime.now(timezone.utc), status=CheckpointStatus.SAVING,
                              metadata=metadata, world_size=self.world,
                              job_config_checksum=sha256_bytes(self.job_json.encode()))
        if self.rank == 0:
            if step_dir.exists():
                shutil.rmtree(step_dir)
            step_dir.mkdir(parents=True)
            (step_dir / "job.json").write_bytes(self.job_json.encode())  # the bytes job_config_checksum covers
            write_manifest(step_dir, manifest, self.key)
            self.on_event("checkpoint", status="SAVING", checkpoint_id=str(manifest.checkpoint_id), step=step, path=str(step_dir))
        dist.barrier()
        pending = _Pending(step_dir, manifest, rng=capture_rng(self.rank))
        optim = {"optimizer": optimizer_state(self.parts, self.optimizers), **self.extra_state()}
        states = {"model": model_state(self.parts), "optim": optim}
        for sub, state in states.items():
            target = str(step_dir / sub)
            if self.async_group is not None and not blocking:
                pending.futures.append(dcp.async_save(state, checkpoint_id=target, process_group=self.async_group))
            else:
                dcp.save(state, checkpoint_id=target)
        self.pending = pending
        if not pending.futures:
            self._finalize()
        return manifest.checkpoint_id

    def poll(self) -> None:
        """At a step boundary: finalise the async save if every rank's write is done (one all-reduce)."""
        if self.pending is None:
            return
        done = torch.tensor([int(all(f.done() for f in self.pending.futures))])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self._finalize_or_raise()

    def wait(self) -> None:
        """Block until the pending save (if any) is written and marked COMPLETE."""
        if self.pending is not None:
            self._finalize_or_raise()

    def _finalize_or_raise(self) -> None:
        pending = self.pending
        assert pending is not None
        try:
            self._finalize()
        except (Exception, CheckpointException) as exc:
            raise self._save_failed(pending.manifest.step, pending.step_dir, exc) from exc

    def _save_failed(self, step: int, step_dir: Path, exc: BaseException) -> CheckpointSaveError:
        """Free what the failed save wrote (on a full disk, that room is what the job needs next) and record why."""
        self.pending = None
        cause = root_cause(exc)
        reason = f"save failed: {type(cause).__name__}: {cause}".strip()
        if self.rank == 0:
            for sub in ("model", "optim"):
                shutil.rmtree(step_dir / sub, ignore_errors=True)
            try:
                manifest = mark(step_dir, CheckpointStatus.CORRUPT, reason, self.key)
                self.on_event("checkpoint", status="CORRUPT", checkpoint_id=str(manifest.checkpoint_id), step=step,
                              path=str(step_dir), reason=reason, during="save")
            except (OSError, ValueError, AssertionError):  # no manifest was written: nothing to mark
                pass
        complete = [m.step for _, m in list_checkpoints(self.dir) if m.status is CheckpointStatus.COMPLETE]
        left = f"the newest COMPLETE checkpoint is step {complete[-1]}" if complete else "no COMPLETE checkpoint exists"
        return CheckpointSaveError(f"the checkpoint at step {step} could not be saved ({reason}; in {step_dir}); "
                                   f"its partial files were removed and {left}")

    def _finalize(self) -> None:
        pending = self.pending
        assert pending is not None
        for future in pending.futures:
            future.result()  # re-raise a failed background write here, on every rank
        local = {"files": self._hash_own_files(pending.step_dir), "rng": pending.rng.model_dump()}
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, local)
        self.pending = None
        if self.rank == 0:
            manifest = self._complete_manifest(pending, gathered)
            write_manifest(pending.step_dir, manifest, self.key)
            self.on_event("checkpoint", status="COMPLETE", checkpoint_id=str(manifest.checkpoint_id),
                          step=manifest.step, path=str(pending.step_dir))
            self._prune()
        dist.barrier()

    def _hash_own_files(self, step_dir: Path) -> list[dict]:
        """This rank's DCP files (rank 0 also takes the .metadata files): path, size, sha256."""
        out = []
        for sub in ("model", "optim"):
            for file in sorted((step_dir / sub).iterdir()):
                match = RANK_FILE.match(file.name)
                owner = int(match.group(1)) if match else 0
                if owner == self.rank:
                    out.append({"file_path": f"{sub}/{file.name}", "file_size_bytes": file.stat().st_size,
                                "checksum": sha256_file(file), "rank": self.rank})
        return out

    @staticmethod
    def _complete_manifest(pending: _Pending, gathered: list[dict]) -> Checkpoint:
        files = sorted((f for item in gathered for f in item["files"]), key=lambda f: (f["rank"], f["file_path"]))
        shards = [ShardRecord(shard_id=i, **f) for i, f in enumerate(x for x in files if x["file_path"].startswith("model/"))]
        optim = [OptimizerStateRecord(**f) for f in files if f["file_path"].startswith("optim/")]
        rng = [RngStateRecord(**item["rng"]) for item in gathered]
        return pending.manifest.model_copy(update={
            "status": CheckpointStatus.COMPLETE, "shards": shards, "optimizer_states": optim, "rng_states": rng})

    def _prune(self) -> None:
        """Keep the newest max_checkpoints_to_keep COMPLETE checkpoints of this job; older ones become
        DELETED. Only this job's (signed with its key, for its id): a folder someone else wrote, or a
        copy of another job's checkpoint, is left alone."""
        complete = [(p, m) for p, m in list_checkpoints(self.dir)
                    if m.status is CheckpointStatus.COMPLETE and own_checkpoint(m, self.key, self.job_id)]
        for step_dir, manifest in complete[:-self.config.max_checkpoints_to_keep]:
            for sub in ("model", "optim"):
                shutil.rmtree(step_dir / sub, ignore_errors=True)
            mark(step_dir, CheckpointStatus.DELETED, "pruned: max_checkpoints_to_keep", self.key)
            self.on_event("checkpoint", status="DELETED", checkpoint_id=str(manifest.checkpoint_id), step=manifest.step,
                          path=str(step_dir))

    # -- loading --

    def candidates(self, resume_from: str | None) -> list[Path]:
        """Checkpoint folders to try, best first: the named one only, or every COMPLETE one newest first."""
        if resume_from:
            return [resolve_checkpoint(resume_from, self.dir)]
        complete = [p for p, m in list_checkpoints(self.dir) if m.status is CheckpointStatus.COMPLETE]
        return list(reversed(complete))

    def _verify_everywhere(self, step_dir: Path, manifest: Checkpoint) -> list[str]:
        """Every rank re-hashes a disjoint share of the files; the problems are gathered on all ranks."""
        records = sorted(r.file_path for r in [*manifest.shards, *manifest.optimizer_states])
        mine = records[self.rank::self.world]
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, verify(step_dir, manifest, mine))
        return [problem for problems in gathered for problem in problems]

    def load(self, resume_from: str | None) -> Checkpoint | None:
        """Restore the newest intact checkpoint (or `resume_from`); None if there is none to resume.
        ProvenanceError if the one to try was not written by this job's service, or was written for
        another job: a planted folder or a copied one stops the job with a message naming it, rather
        than being loaded or silently passed over."""
        for step_dir in self.candidates(resume_from):
            manifest = read_manifest(step_dir)
            assert manifest is not None
            check_provenance(step_dir, manifest, self.key, self.job_id)
            if manifest.status is not CheckpointStatus.COMPLETE:
                if resume_from:
                    raise ValueError(f"--resume-from: checkpoint {step_dir} is {manifest.status.value}, not COMPLETE")
                continue
            problems = self._verify_everywhere(step_dir, manifest)
            if problems:
                self._report_corrupt(step_dir, manifest, problems)
                if resume_from:
                    raise ValueError(f"--resume-from: checkpoint {step_dir} is corrupt: {'; '.join(problems)}")
                continue
            self._load_state(step_dir, manifest)
            return manifest
        return None

    def _report_corrupt(self, step_dir: Path, manifest: Checkpoint, problems: list[str]) -> None:
        reason = "; ".join(problems)
        if self.rank == 0:
            log.error("checkpoint %s (step %d) failed verification: %s -- marked CORRUPT, trying the previous one",
                      step_dir, manifest.step, reason)
            mark(step_dir, CheckpointStatus.CORRUPT, reason, self.key)
            self.on_event("checkpoint", status="CORRUPT", checkpoint_id=str(manifest.checkpoint_id),
                          step=manifest.step, path=str(step_dir), reason=reason, during="resume")
        dist.barrier()

    def _load_state(self, step_dir: Path, manifest: Checkpoint) -> None:
        model_sd = model_state(self.parts)
        dcp.load(model_sd, checkpoint_id=str(step_dir / "model"))
        for part in self.parts:
            set_model_state_dict(part, model_sd, options=StateDictOptions(strict=False))
        optim = {"optimizer": optimizer_state(self.parts, self.optimizers), **self.extra_state()}
        dcp.load(optim, checkpoint_id=str(step_dir / "optim"))
        for part, optimizer in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, optimizer, optim["optimizer"], options=FLAT)
        self.load_extra_state(optim)
        if manifest.world_size == self.world:
            restore_rng(next(r for r in manifest.rng_states if r.rank == self.rank))
