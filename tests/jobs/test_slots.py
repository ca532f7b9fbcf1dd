"""The PENDING queue: strict FIFO by queue order, never more slots than free (property-based)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedllm.jobs.records import JobRecord, JobState
from pagedllm.jobs.slots import startable, used_slots


def job(seq: int, world: int, status: JobState = JobState.PENDING) -> JobRecord:
    return JobRecord(job_id=str(seq), job_name="j", status=status, config={}, world_size=world, queue_seq=seq,
                     created_at=0.0, updated_at=0.0)


@given(worlds=st.lists(st.integers(1, 4), max_size=8), free=st.integers(0, 8), data=st.data())
def test_startable_is_a_fitting_prefix_of_the_queue(worlds, free, data):
    seqs = data.draw(st.permutations(range(len(worlds))))
    pending = [job(seq, world) for seq, world in zip(seqs, worlds)]
    chosen = startable(pending, free)
    queue = sorted(pending, key=lambda j: j.queue_seq)
    assert chosen == queue[:len(chosen)]  # submission order, nobody jumps the queue
    assert sum(j.world_size for j in chosen) <= free
    if len(chosen) < len(queue):  # the head of what is left does not fit
        assert queue[len(chosen)].world_size > free - sum(j.world_size for j in chosen)


def test_a_big_job_at_the_head_blocks_smaller_ones_behind_it():
    assert startable([job(2, 1), job(1, 2)], 1) == []
    assert [j.queue_seq for j in startable([job(2, 1), job(1, 2)], 3)] == [1, 2]


def test_used_slots_counts_only_jobs_with_processes():
    jobs = [job(1, 2, JobState.RUNNING), job(2, 1, JobState.CHECKPOINTING), job(3, 4, JobState.PENDING),
            job(4, 8, JobState.COMPLETED), job(5, 8, JobState.FAILED), job(6, 8, JobState.CANCELLED)]
    assert used_slots(jobs) == 3
