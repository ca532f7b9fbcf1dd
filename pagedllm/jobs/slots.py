"""Slots and the PENDING queue: which jobs may start now.

A job needs one slot per process (its world size: tp x pp x cp x dp). The queue is strict FIFO in
queue order (submission, or resume): a job that does not fit the free slots blocks the ones behind
it, so a large job is never starved by a stream of small ones.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedllm.jobs.records import JobRecord


def used_slots(jobs: Iterable[JobRecord]) -> int:
    """Slots held by the jobs that have (or may have) processes."""
    return sum(job.world_size for job in jobs if job.status.active)


def startable(pending: Iterable[JobRecord], free_slots: int) -> list[JobRecord]:
    """The jobs to start now, head of the queue first, stopping at the first one that does not fit."""
    chosen = []
    for job in sorted(pending, key=lambda j: j.queue_seq):
        if job.world_size > free_slots:
            break
        chosen.append(job)
        free_slots -= job.world_size
    return chosen
