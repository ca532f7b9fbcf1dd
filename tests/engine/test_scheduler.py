"""Scheduler: token budget, queue order, chunked prefill, preemption policies and modes."""
from __future__ import annotations

import pytest

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, budget=64, chunked=True, mode="recompute", policy="fcfs", cpu_blocks=64, max_num_seqs=16):
    bm = BlockManager(num_blocks, block_size, cpu_blocks if mode == "swap" else 0)
    config = SchedulerConfig(max_num_seqs, budget, 4096, chunked, mode, policy)
    return Scheduler(config, bm)


def make_seq(name: str, prompt_len: int, arrival: float = 0.0, priority: int = 0, max_tokens: int = 16) -> Sequence:
    request = Request(name, None, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), arrival, priority)
    seq = Sequence(request, 0, list(request.prompt_token_ids), None)
    request.seqs.append(seq)
    return seq


def run_step(scheduler: Scheduler):
    """Schedule, then do what the engine does after the forward pass: advance and sample."""
    out = scheduler.schedule()
    for item in out.scheduled:
        completes = item.completes_context
        item.seq.num_computed_tokens += item.num_new_tokens
        if completes:
            item.seq.token_ids.append(7)
    return out


def test_waiting_queue_is_priority_then_arrival():
    scheduler = make_scheduler(budget=1000)
    for name, arrival, priority in [("late-low", 3, 0), ("early-low", 1, 0), ("high", 2, 5)]:
        scheduler.add(make_seq(name, 4, arrival, priority))
    out = scheduler.schedule()
    assert [s.seq.request.request_id for s in out.scheduled] == ["high", "early-low", "late-low"]


def test_budget_decodes_first_then_prefill_chunks():
    scheduler = make_scheduler(budget=10)
    a = make_seq("a", 6, arrival=0)
    scheduler.add(a)
    run_step(scheduler)  # a prefilled (6 tokens)
    b = make_seq("b", 30, arrival=1)
    scheduler.add(b)
    chunks = []
    while b.is_prefill or b.num_computed_tokens == 0:
        out = run_step(scheduler)
        assert out.num_batched_tokens <= 10
        assert (out.scheduled[0].seq, out.scheduled[0].num_new_tokens) == (a, 1)  # decode first
        chunks.append(out.scheduled[1].num_new_tokens)
    assert chunks == [9, 9, 9, 3]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=10, chunked=False)
    scheduler.add(make_seq("a", 8))
    scheduler.add(make_seq("b", 8, arrival=1))
    out = run_step(scheduler)
    assert [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 8)]
    out = run_step(scheduler)
    assert [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]


def fill_pool(policy: str, mode: str = "recompute"):
    """Three running sequences that exactly fill a 6-block pool; the next decode must preempt."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=100, mode=mode, policy=policy)
    seqs = [
        make_seq("first", 8, arrival=0, priority=1, max_tokens=50),
        make_seq("second", 8, arrival=1, priority=0, max_tokens=9),
        make_seq("third", 8, arrival=2, priority=2, max_tokens=30),
    ]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler)  # all three prefill 8 tokens = 2 blocks each; each samples a 9th token
    assert scheduler.block_manager.num_free_blocks == 0
    return scheduler, {s.request.request_id: s for s in seqs}


@pytest.mark.parametrize(
    "policy, victim",
    [("fcfs", "third"), ("priority", "second"), ("shortest_remaining", "second")],
)
def test_preemption_policy_picks_its_victim(policy, victim):
    scheduler, seqs = fill_pool(policy)
    out = run_step(scheduler)
    assert [s.request.request_id for s in out.preempted] == [victim]
    assert seqs[victim].status is SequenceStatus.WAITING and seqs[victim].num_computed_tokens == 0
    assert scheduler.num_preemptions == 1
    assert {s.seq.request.request_id for s in out.scheduled} == set(seqs) - {victim}
    scheduler.block_manager.check_invariants()


def test_swap_preemption_moves_blocks_and_swaps_back_before_admitting():
    scheduler, seqs = fill_pool("fcfs", mode="swap")
    out = run_step(scheduler)
    third = seqs["third"]
    assert third.status is SequenceStatus.SWAPPED and len(out.blocks_to_swap_out) == 2
    assert third.num_computed_tokens == 8  # its KV is kept, on the host
    newcomer = make_seq("newcomer", 2, arrival=5, priority=9)
    scheduler.add(newcomer)
    scheduler.remove(seqs["first"])  # frees room
    out = run_step(scheduler)
    assert third.status is SequenceStatus.RUNNING and len(out.blocks_to_swap_in) == 2
    assert newcomer.status is SequenceStatus.WAITING  # swapped sequences come back first
    scheduler.block_manager.check_invariants()


def test_sequence_longer_than_the_pool_ends_with_length():
    scheduler = make_scheduler(num_blocks=2, block_size=4, budget=100)
    seq = make_seq("a", 7, max_tokens=100)
    scheduler.add(seq)
    run_step(scheduler)
    run_step(scheduler)  # 9 tokens now: 3 blocks would be needed, the pool has 2
    out = scheduler.schedule()
    assert out.ended == [seq] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert scheduler.block_manager.num_free_blocks == 2


def test_swapped_sequence_that_outgrew_the_pool_ends_instead_of_blocking():
    scheduler = make_scheduler(num_blocks=2, block_size=4, budget=100, mode="swap")
    seq = make_seq("a", 7, max_tokens=100)
    scheduler.add(seq)
    run_step(scheduler)  # 8 tokens: exactly the pool
    scheduler.block_manager.swap_out(seq.seq_id)
    scheduler.running.remove(seq)
    seq.set_status(SequenceStatus.SWAPPED)
    scheduler.swapped.append(seq)
    seq.token_ids.append(7)  # 9 tokens can never fit in 2 blocks of 4
    newcomer = make_seq("b", 3, arrival=1)
    scheduler.add(newcomer)
    out = run_step(scheduler)
    assert out.ended == [seq] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert [s.seq for s in out.scheduled] == [newcomer]
    scheduler.block_manager.check_invariants()
