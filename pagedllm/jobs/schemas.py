"""The REST API's request and response bodies (the platform's training and cluster-management APIs).

A job is answered as the platform's TrainingJob (the training package's model, so the config schema is
defined once) with the service's state and current metrics added.
"""
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.jobs.records import JobState
from pagedllm.training.checkpoint import Checkpoint
from pagedllm.training.config import TrainingJob


class CheckpointSummary(BaseModel):
    checkpoint_id: uuid.UUID
    step: int
    status: str
    timestamp: datetime


class CurrentMetrics(BaseModel):
    """The newest step record, and the newest COMPLETE checkpoint."""

    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    consumed_tokens: int | None = None
    val_loss: float | None = None
    last_checkpoint: CheckpointSummary | None = None


class StateChange(BaseModel):
    status: JobState
    at: datetime
    reason: str | None = None


class RunView(BaseModel):
    run: int
    started_at: datetime
    resumed_from: str | None = None
    start_step: int | None = Field(None, description="the step the run started after (a resume's checkpoint step)")
    ended_at: datetime | None = None
    exit_code: int | None = None
    outcome: JobState | None = None


class ProcessView(BaseModel):
    rank: int
    pid: int | None = None
    host: str
    node_id: str | None = Field(None, description="the Ray node the rank runs on (--cluster ray)")
    address: str | None = Field(None, description="that node's address")


class JobView(TrainingJob):
    """GET /v1/training/jobs/{job_id}: the TrainingJob, its state and its current metrics."""

    status: JobState  # the TrainingJob states plus CANCELLED
    world_size: int
    started_at: datetime | None = None
    finished_at: datetime | None = None
    failure_reason: str | None = None
    cancel_requested: bool = False
    pid: int | None = Field(None, description="the launcher (torchrun) of the current or last run")
    processes: list[ProcessView] = Field(default_factory=list, description="the ranks of the current or last run")
    metrics: CurrentMetrics = Field(default_factory=CurrentMetrics)
    runs: list[RunView] = Field(default_factory=list)
    history: list[StateChange] = Field(default_factory=list)


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobView]


class JobCreated(BaseModel):
    job_id: uuid.UUID
    status: JobState


class JobStatusResponse(BaseModel):
    """DELETE answers {"status": "CANCELLED"}; resume answers {"job_id", "status"}."""

    job_id: uuid.UUID
    status: JobState


class CheckpointRequested(BaseModel):
    checkpoint_id: uuid.UUID
    status: JobState


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint_id: uuid.UUID | None = Field(None, description="default: the newest COMPLETE checkpoint")
    data_parallel_size: int | None = Field(None, ge=1, description=(
        "resume on this many data-parallel replicas (e.g. after a node was lost); the checkpoint is resharded "
        "and the global batch kept"))


class CheckpointView(Checkpoint):
    """The platform's Checkpoint record (manifest.json), and where it is on disk."""

    path: str | None = None


class MetricsList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict]


class LogChunk(BaseModel):
    offset: int = Field(description="byte offset of `text` in the log")
    next_offset: int = Field(description="pass as ?offset= to read on from here")
    size: int = Field(description="the log's size in bytes now")
    text: str


class ClusterStatus(BaseModel):
    """The cluster status of the platform's management API. On a node without GPUs the devices are CPU worker slots (--train-slots)
    and gpu_utilization is the CPU utilisation."""

    device_type: Literal["cuda", "cpu"]
    total_gpus: int
    available_gpus: int
    gpu_utilization: float = Field(description="0..1, measured (psutil / NVML)")
    memory_utilization: float = Field(description="0..1: device memory on GPUs, RAM on CPU")
    active_jobs: int
    pending_jobs: int


class NodeJob(BaseModel):
    job_id: str
    ranks: list[int]


class ClusterNode(BaseModel):
    node_id: str
    gpus: int = Field(description="devices jobs may use: GPUs, or CPU worker slots")
    device_type: Literal["cuda", "cpu"]
    status: Literal["ready", "busy", "dead"]
    gpu_memory_used: list[float] = Field(description="GiB used per GPU; on CPU one value: RAM used (empty until measured)")
    memory_total: list[float] = Field(description="GiB per GPU; on CPU one value: RAM")
    address: str | None = Field(None, description="the node's address (Ray's node manager address)")
    hostname: str | None = None
    alive: bool = True
    cpus: float | None = Field(None, description="CPUs the node has (Ray: its CPU resource)")
    gpu_count: float | None = Field(None, description="GPUs the node has")
    free_slots: int | None = Field(None, description="of `gpus`, not held by a job or a serving replica")
    jobs: list[NodeJob] = Field(default_factory=list, description="the jobs whose ranks run on this node")
