"""REST routes of the training job service (training jobs, their checkpoints, and the cluster's status).

Handlers resolve the service from app.state and translate its exceptions into the server's
OpenAI-shaped errors: an invalid config is 400 naming the field, an unknown job or checkpoint 404, a
request the job's state does not allow 409, a service without its data dir 503.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from pagedllm.http_errors import (
    APIError,
    BadRequestError,
    ConflictError,
    ErrorResponse,
    NotFoundError,
    ServiceUnavailableError,
    error_responses,
)
from pagedllm.jobs import logs
from pagedllm.jobs.body import INT64_MAX, BodyError, parse_body
from pagedllm.jobs.records import JobState
from pagedllm.jobs.schemas import (
    CheckpointRequested,
    CheckpointView,
    ClusterNode,
    ClusterStatus,
    JobCreated,
    JobList,
    JobStatusResponse,
    JobView,
    LogChunk,
    MetricsList,
    ResumeRequest,
)
from pagedllm.jobs.service import JobNotFound, JobService, QueueFull, Unavailable, WrongState
from pagedllm.jobs.views import checkpoint_views, job_view
from pagedllm.training.config import ConfigError

jobs_router = APIRouter(tags=["training"], responses=error_responses(400, 404, 409, 503))
JOB = "/v1/training/jobs/{job_id}"


class QueueFullError(APIError):
    """429: as many jobs wait as the server allows (--max-pending-jobs). 429, not 503: the limit is on
    what callers queued, it clears when jobs start or are cancelled (minutes, not the seconds a
    Retry-After would promise), and it is what OpenAI's fine-tuning API answers to too many queued jobs."""

    status_code = 429
    default_code = "queue_full"


QUEUE_FULL_RESPONSE = {"model": ErrorResponse, "description": "as many jobs wait as --max-pending-jobs allows (`queue_full`)"}


def service(request: Request) -> JobService:
    return request.app.state.jobs


@contextmanager
def api_errors() -> Iterator[None]:
    try:
        yield
    except ConfigError as exc:
        raise BadRequestError(str(exc), param=exc.field, code="invalid_config") from exc
    except JobNotFound as exc:
        raise NotFoundError(str(exc), param=exc.param) from exc
    except WrongState as exc:
        raise ConflictError(str(exc), code="invalid_job_state") from exc
    except Unavailable as exc:
        raise ServiceUnavailableError(str(exc)) from exc
    except QueueFull as exc:
        raise QueueFullError(str(exc)) from exc


JOB_BODY = {"requestBody": {"required": True, "description": (
    "a TrainingJob without job_id and status (the schema of `pagedllm train --config`), as JSON, "
    "or as the TOML of a job file with Content-Type: application/toml"), "content": {
        "application/json": {"schema": {"type": "object"}},
        "application/toml": {"schema": {"type": "string"}},
    }}}


@jobs_router.post("/v1/training/jobs", response_model=JobCreated, openapi_extra=JOB_BODY,
                  responses={429: QUEUE_FULL_RESPONSE})
async def submit_job(request: Request) -> JobCreated:
    raw = await request.body()
    with api_errors():
        try:
            body = parse_body(raw, request.headers.get("content-type", ""))
        except BodyError as exc:
            raise BadRequestError(str(exc)) from exc
        job = await service(request).submit(body)
    return JobCreated(job_id=job.job_id, status=job.status)


@jobs_router.get("/v1/training/jobs", response_model=JobList)
async def list_jobs(request: Request, status: list[JobState] | None = Query(None)) -> JobList:
    jobs = service(request)
    with api_errors():
        store = jobs.require()
        return JobList(data=[job_view(store, job) for job in store.jobs(status)])


@jobs_router.get(JOB, response_model=JobView)
async def get_job(request: Request, job_id: str) -> JobView:
    jobs = service(request)
    with api_errors():
        return job_view(jobs.require(), jobs.get(job_id))


@jobs_router.delete(JOB, response_model=JobStatusResponse)
async def cancel_job(request: Request, job_id: str,
                     grace_seconds: float | None = Query(None, ge=0, le=3600,
                                                         description="SIGTERM first, SIGKILL after this (default: the server's)")) -> JobStatusResponse:
    with api_errors():
        status = await service(request).cancel(job_id, grace_seconds)
    return JobStatusResponse(job_id=job_id, status=status)


@jobs_router.post(JOB + "/checkpoint", response_model=CheckpointRequested)
async def checkpoint_job(request: Request, job_id: str) -> CheckpointRequested:
    with api_errors():
        checkpoint_id = service(request).request_checkpoint(job_id)
    return CheckpointRequested(checkpoint_id=checkpoint_id, status=JobState.CHECKPOINTING)


@jobs_router.get(JOB + "/checkpoints", response_model=list[CheckpointView])
async def list_checkpoints(request: Request, job_id: str) -> list[CheckpointView]:
    with api_errors():
        return checkpoint_views(service(request).checkpoints(job_id))


@jobs_router.post(JOB + "/resume", response_model=JobStatusResponse, responses={429: QUEUE_FULL_RESPONSE})
async def resume_job(request: Request, job_id: str, body: ResumeRequest | None = None) -> JobStatusResponse:
    checkpoint_id = str(body.checkpoint_id) if body is not None and body.checkpoint_id is not None else None
    data_parallel_size = body.data_parallel_size if body is not None else None
    with api_errors():
        status = await service(request).resume(job_id, checkpoint_id, data_parallel_size)
    return JobStatusResponse(job_id=job_id, status=status)


@jobs_router.get(JOB + "/metrics", response_model=MetricsList)
async def job_metrics(request: Request, job_id: str, since_step: int = Query(0, ge=0, le=INT64_MAX),
                      limit: int | None = Query(None, ge=1, le=INT64_MAX)) -> MetricsList:
    jobs = service(request)
    with api_errors():
        jobs.get(job_id)
        return MetricsList(data=jobs.require().metrics(job_id, since_step, limit))


@jobs_router.get(JOB + "/logs", response_model=LogChunk,
                 responses={200: {"description": "JSON, or text/plain streamed until the job ends when follow=true",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def job_logs(request: Request, job_id: str,
                   offset: int | None = Query(None, ge=0, le=INT64_MAX, description="byte offset to read from (default 0)"),
                   tail: int | None = Query(None, ge=1, le=INT64_MAX, description="start at the last N lines instead"),
                   limit: int = Query(logs.MAX_CHUNK, ge=1, le=logs.MAX_CHUNK, description="bytes at most"),
                   follow: bool = Query(False, description="stream as text/plain until the job has ended")):
    jobs = service(request)
    with api_errors():
        path = jobs.log_path(job_id)
    if offset is not None and tail is not None:
        raise BadRequestError("pass either offset or tail, not both", param="tail")
    start = logs.tail_offset(path, tail) if tail is not None else offset or 0
    if follow:
        def finished() -> bool:
            return jobs.store is None or jobs.get(job_id).status.terminal

        return StreamingResponse(logs.follow(path, start, finished), media_type="text/plain; charset=utf-8")
    return logs.read_chunk(path, start, limit)


@jobs_router.get("/v1/cluster/status", response_model=ClusterStatus, tags=["cluster"])
async def cluster_status(request: Request) -> ClusterStatus:
    jobs = service(request)
    with api_errors():
        return jobs.cluster_status()


@jobs_router.get("/v1/cluster/nodes", response_model=list[ClusterNode], tags=["cluster"])
async def cluster_nodes(request: Request) -> list[ClusterNode]:
    jobs = service(request)
    with api_errors():
        return jobs.cluster_nodes()
