"""Store records -> the API's bodies (unix seconds become ISO 8601 UTC)."""
from __future__ import annotations

from datetime import datetime, timezone

from pagedllm.jobs.body import printable
from pagedllm.jobs.records import JobRecord
from pagedllm.jobs.schemas import CheckpointSummary, CheckpointView, CurrentMetrics, JobView, RunView, StateChange
from pagedllm.jobs.store import JobStore
from pagedllm.training.checkpoint import CheckpointStatus


def _time(seconds: float | None) -> datetime | None:
    return datetime.fromtimestamp(seconds, timezone.utc) if seconds is not None else None


def current_metrics(store: JobStore, job: JobRecord) -> CurrentMetrics:
    latest = store.latest_metrics(job.job_id) or {}
    complete = [c for c in store.checkpoints(job.job_id) if c["status"] == CheckpointStatus.COMPLETE.value]
    last = max(complete, key=lambda c: c["step"]) if complete else None
    return CurrentMetrics(
        **{k: latest.get(k) for k in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_tokens", "val_loss")},
        total_steps=job.total_steps,
        last_checkpoint=CheckpointSummary(**{k: last[k] for k in ("checkpoint_id", "step", "status", "timestamp")}) if last else None,
    )


def job_view(store: JobStore, job: JobRecord) -> JobView:
    runs = [RunView(**{**vars(r), "started_at": _time(r.started_at), "ended_at": _time(r.ended_at)})
            for r in store.runs(job.job_id)]
    history = [StateChange(status=t.status, at=_time(t.at), reason=printable(t.reason)) for t in store.history(job.job_id)]
    return JobView.model_validate({
        **printable(job.config),  # a row stored before text was checked may hold a lone surrogate
        "status": job.status, "world_size": job.world_size,
        "created_at": _time(job.created_at), "updated_at": _time(job.updated_at),
        "started_at": _time(job.started_at), "finished_at": _time(job.finished_at),
        "failure_reason": printable(job.failure_reason), "cancel_requested": job.cancel_requested,
        "pid": job.pid, "processes": job.processes,
        "metrics": current_metrics(store, job), "runs": runs, "history": history,
    })


def checkpoint_views(records: list[dict]) -> list[CheckpointView]:
    """The records without the trainer's internals (RNG states, the signature), which the store no
    longer keeps (records of older servers still may)."""
    return [CheckpointView.model_validate({k: v for k, v in r.items() if k not in INTERNAL}) for r in records]


INTERNAL = ("rng_states", "signature")
