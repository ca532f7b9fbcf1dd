"""Scheduler: token budget, queue order, chunked prefill, preemption policies and modes."""
from __future__ import annotations

import pytest

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken


def make_scheduler(num_blocks=64, block_size=4, budget=64, chunked=True, mode="recompute", policy="fcfs", cpu_blocks=64, max_num_seqs=16):
    bm = BlockManager(num_blocks, block_size, cpu_blocks if mode == "swap" else 0)
    config = SchedulerConfig(max_num_seqs, budget, 4096, chunked, mode, policy)
    return Scheduler(config, bm)


def make_seq(name: str, prompt_len: int, arrival: float = 0.0, priority: int = 0, max_tokens: int = 16, first_token: int = 10) -> Sequence:
    request = Request(name, None, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens=max_tokens), arrival, priority)
    seq = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    return seq


def run_step(scheduler: Scheduler):
    """Schedule, then hand back what a runner would: token 7 for every chunk that samples."""
    out = scheduler.schedule()
    sampled = {chunk.seq_id: [SampledToken(7, 0.0)] for chunk in out.chunks if chunk.token_budget}
    scheduler.update_from_output(ModelRunnerOutput(sampled), lambda seq, token: None)
    return out


def scheduled(out) -> list[tuple[int, int]]:
    """(seq id, tokens) of each scheduled chunk, in schedule order."""
    return [(chunk.seq_id, chunk.num_tokens) for chunk in out.chunks]


def test_waiting_queue_is_priority_then_arrival():
    scheduler = make_scheduler(budget=1000)
    seqs = {}
    for name, arrival, priority in [("late-low", 3, 0), ("early-low", 1, 0), ("high", 2, 5)]:
        seqs[name] = make_seq(name, 4, arrival, priority)
        scheduler.add(seqs[name])
    out = scheduler.schedule()
    assert [c.seq_id for c in out.chunks] == [seqs[n].seq_id for n in ("high", "early-low", "late-low")]


def test_budget_decodes_first_then_prefill_chunks():
    scheduler = make_scheduler(budget=10)
    a = make_seq("a", 6, arrival=0)
    scheduler.add(a)
    run_step(scheduler)  # a prefilled (6 tokens)
    b = make_seq("b", 30, arrival=1, first_token=100)  # no prefix shared with a
    scheduler.add(b)
    chunks = []
    while b.is_prefill or b.num_computed_tokens == 0:
        out = run_step(scheduler)
        assert out.num_batched_tokens <= 10
        assert scheduled(out)[0] == (a.seq_id, 1)  # decode first
        chunks.append(out.chunks[1].num_tokens)
    assert chunks == [9, 9, 9, 3]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=10, chunked=False)
    a, b = make_seq("a", 8), make_seq("b", 8, arrival=1, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    out = run_step(scheduler)
    assert scheduled(out) == [(a.seq_id, 8)]
    out = run_step(scheduler)
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 8)]


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
    assert out.preempted_seq_ids == [seqs[victim].seq_id]
    assert seqs[victim].status is SequenceStatus.WAITING and seqs[victim].num_computed_tokens == 0
    assert scheduler.num_preemptions == 1
    assert {c.seq_id for c in out.chunks} == {s.seq_id for name, s in seqs.items() if name != victim}
    scheduler.block_manager.check_invariants()


def test_swap_preemption_moves_blocks_and_swaps_back_before_admitting():
    scheduler, seqs = fill_pool("fcfs", mode="swap")
    out = run_step(scheduler)
    third = seqs["third"]
    assert third.status is SequenceStatus.SWAPPED and len(out.blocks_to_swap_out) == 2
    assert third.num_computed_tokens == 8  # its KV is kept, on the host
    newcomer = make_seq("newcomer", 2, arrival=5, priority=9)
    scheduler.add(newcomer)
    scheduler.finish(seqs["first"], SequenceStatus.FINISHED_ABORTED)  # frees room
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
    assert out.finished_seq_ids == [seq.seq_id] and seq.status is SequenceStatus.FINISHED_LENGTH
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
    assert out.finished_seq_ids == [seq.seq_id] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert scheduled(out) == [(newcomer.seq_id, 3)]
    scheduler.block_manager.check_invariants()
