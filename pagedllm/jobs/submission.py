"""From a POST body to a job config `pagedllm train` will accept, checked before anything starts.

The checks are the trainer's own: the body is parsed as the training package's TrainingJob (field
errors), then run through `pagedllm train`'s `check_job` for the world size the job will launch
with (cross-field rules, dataset and tokenizer paths). Every failure is a ConfigError naming the
field. Every path is resolved under the server's allowed roots (confinement.py) and stored absolute,
because the job may be launched or resumed by a server started from another directory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.jobs.confinement import AllowedRoots, confine_base_model, confine_checkpoint_dir, confine_data
from pagedllm.training.checks import check_job
from pagedllm.training.config import ConfigError, TrainingJob, parse_job

SERVICE_FIELDS = ("job_id", "status", "created_at", "updated_at")
NOT_SAVED = {"status", "created_at", "updated_at"}


def build_config(body: dict[str, Any], job_id: str, roots: AllowedRoots, slots: int,
                 slots_name: str = "training slots of this server (--train-slots)") -> tuple[dict, int]:
    """(the job's config as JSON-ready dict by alias, its world size); ConfigError if it cannot run."""
    for name in SERVICE_FIELDS:
        if name in body:
            raise ConfigError(name, "is set by the job service; leave it out of the request")
    job = parse_job({**body, "job_id": job_id})
    world = job.parallelism.world_size
    if world > slots:
        raise ConfigError("parallelism_config",
                          f"the job needs {world} processes (tensor x pipeline x context x data parallel sizes), "
                          f"more than the {slots} {slots_name}")
    job = _with_confined_paths(job, job_id, roots)
    if job.finetune is not None:  # stored with the base's shape, so every later parse of it agrees with the base
        from pagedllm.training.pretrained import apply_base_model

        job = apply_base_model(job)
    config = job.model_dump(mode="json", by_alias=True, exclude=NOT_SAVED)
    check_runnable(config, world)
    return config, world


def _with_confined_paths(job: TrainingJob, job_id: str, roots: AllowedRoots) -> TrainingJob:
    """Default checkpoint_dir: <data_dir>/jobs/<id>/checkpoints; every path resolved under the allowed roots."""
    ckpt = job.checkpoint
    if "checkpoint_dir" in ckpt.model_fields_set:
        checkpoint_dir = confine_checkpoint_dir(ckpt.checkpoint_dir, roots)
    else:
        checkpoint_dir = roots.data_dir / "jobs" / job_id / "checkpoints"
    data = confine_data(job.data.model_dump(), roots)
    updates = {"checkpoint": ckpt.model_copy(update={"checkpoint_dir": str(checkpoint_dir)}),
               "data": job.data.model_copy(update=data)}
    if job.finetune is not None:
        updates["finetune"] = job.finetune.model_copy(update={"base_model": confine_base_model(job.finetune.base_model, roots)})
    return job.model_copy(update=updates)


def check_runnable(config: dict, world_size: int) -> None:
    """`pagedllm train`'s own checks for `world_size` processes on one node (ConfigError naming the field)."""
    check_job(parse_job(config), world_size)


def check_checkpoint_dir(config: dict, job_id: str, used_by: dict[str, str]) -> None:
    """A checkpoint_dir belongs to one job: its checkpoints are what that job resumes from."""
    path = config["checkpoint_config"]["checkpoint_dir"]
    owner = used_by.get(path)
    if owner is None:
        owner = _job_id_in(Path(path) / "job.json")
    if owner is not None and owner != job_id:
        raise ConfigError("checkpoint_config.checkpoint_dir", f"{path} already holds the checkpoints of job {owner}")


def _job_id_in(path: Path) -> str | None:
    """The job_id `pagedllm train` wrote into a checkpoint_dir (None: no job there)."""
    try:
        return str(json.loads(path.read_text()).get("job_id") or "") or None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return f"(unreadable {path})"
