"""Scheduler: token budget, queue order, chunked prefill, preemption policies and modes."""
from __future__ import annotations

import pytest

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.step.scheduler_output import PENDING_TOKEN


def make_scheduler(num_blocks=64, block_size=4, budget=64, chunked=True, mode="recompute", policy="priority", cpu_blocks=64,
                   max_num_seqs=16, watermark=0.0, cap=0, secure=False, max_step_blocks=None, max_loras=0):
    bm = BlockManager(num_blocks, block_size, cpu_blocks if mode == "swap" else 0, secure=secure)
    config = SchedulerConfig(max_num_seqs, budget, 4096, chunked, mode, policy, watermark=watermark,
                             long_prefill_token_threshold=cap, max_step_blocks=max_step_blocks, max_loras=max_loras)
    return Scheduler(config, bm)


def make_seq(name: str, prompt_len: int, arrival: float = 0.0, priority: int = 0, max_tokens: int = 16, first_token: int = 10,
             best_of: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=1, best_of=best_of)
    request = Request(name, None, list(range(first_token, first_token + prompt_len)), params, arrival, priority)
    seq = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    return seq


def run_step(scheduler: Scheduler):
    """Schedule, then hand back what a runner would: token 7 for every chunk that samples."""
    out = scheduler.schedule()
    scheduler.update_from_output(ModelRunnerOutput(runner_tokens(out)), lambda seq, token: None)
    return out


def runner_tokens(out) -> dict[int, list[SampledToken]]:
    """Token 7 for every chunk that samples and every sample forked this step (n / best_of)."""
    sampled = {chunk.seq_id: [SampledToken(7, 0.0)] for chunk in out.chunks if chunk.token_budget}
    sampled.update((new.seq_id, [SampledToken(7, 0.0)]) for new in out.new_seqs if new.forked_from is not None)
    return sampled


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


def test_admission_counts_the_samples_a_request_will_fork():
    """max_num_seqs=4: a best_of=3 request runs as 3 sequences once its prompt is computed, so a
    best_of=1 request fits beside it (exactly 4) and the next one waits — in the same step as the
    admission, before the fork, too."""
    scheduler = make_scheduler(max_num_seqs=4, budget=100)
    wide = make_seq("wide", 4, arrival=0, best_of=3)
    one, two = make_seq("one", 4, arrival=1, first_token=100), make_seq("two", 4, arrival=2, first_token=200)
    for seq in (wide, one, two):
        scheduler.add(seq)
    out = run_step(scheduler)
    assert scheduled(out) == [(wide.seq_id, 4), (one.seq_id, 4)]
    assert len(scheduler.running) == 4 and two.status is SequenceStatus.WAITING
    with pytest.raises(ValueError, match="best_of=5 exceeds max_num_seqs=4"):
        scheduler.add(make_seq("too-wide", 4, best_of=5))


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=10, chunked=False)
    a, b = make_seq("a", 8), make_seq("b", 8, arrival=1, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    out = run_step(scheduler)
    assert scheduled(out) == [(a.seq_id, 8)]
    out = run_step(scheduler)
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 8)]


def test_a_block_shortage_stops_admission_at_the_head_of_the_queue():
    """Design 000 Algorithm 2 phase 3: admit while blocks fit, then stop. A prompt that does not
    fit the free blocks now holds back the smaller, later one that would fit: it is not skipped
    (which would starve it), and it runs once the blocks come free."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=100)
    running = make_seq("running", 11, arrival=0, max_tokens=2)  # 3 blocks once it samples
    scheduler.add(running)
    run_step(scheduler)
    big = make_seq("big", 16, arrival=1, first_token=100)  # 4 blocks: 3 are free
    small = make_seq("small", 4, arrival=2, first_token=200)  # 1 block would fit
    scheduler.add(big)
    scheduler.add(small)
    out = run_step(scheduler)
    assert scheduled(out) == [(running.seq_id, 1)]
    assert big.status is small.status is SequenceStatus.WAITING
    assert scheduler.block_manager.num_free_blocks == 3  # the failed admission kept nothing
    scheduler.finish(running, SequenceStatus.FINISHED_STOPPED)
    assert scheduled(run_step(scheduler)) == [(big.seq_id, 16), (small.seq_id, 4)]


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


# All three are admitted in the same step, in the waiting queue's order (third, first, second), so
# fcfs (latest admitted) preempts "second" too; test_fcfs_preempts_the_latest_admitted separates them.
@pytest.mark.parametrize(
    "policy, victim",
    [("fcfs", "second"), ("priority", "second"), ("shortest_remaining", "second")],
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
    scheduler, seqs = fill_pool("priority", mode="swap")
    out = run_step(scheduler)
    victim = seqs["second"]
    assert out.preempted_seq_ids == [] and victim.status is SequenceStatus.SWAPPED and len(out.blocks_to_swap_out) == 2
    assert victim.num_computed_tokens == 8  # its KV is kept, on the host
    newcomer = make_seq("newcomer", 2, arrival=5, priority=9)
    scheduler.add(newcomer)
    scheduler.finish(seqs["first"], SequenceStatus.FINISHED_ABORTED)  # frees room
    out = run_step(scheduler)
    assert victim.status is SequenceStatus.RUNNING and len(out.blocks_to_swap_in) == 2
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


# ---- decode-first budget and the per-sequence prefill cap (issue 31, item 1) ----------------------
def finish_at_max_tokens(seq, token):
    return SequenceStatus.FINISHED_LENGTH if seq.num_output_tokens >= seq.request.params.max_tokens else None


def test_running_decodes_get_their_token_before_a_higher_priority_prefill():
    """A prefill that outranks a decode (priority here) once took the whole budget from it."""
    scheduler = make_scheduler(budget=10)
    low = make_seq("low", 3, arrival=0, priority=0)
    scheduler.add(low)
    run_step(scheduler)  # low decodes from now on
    high = make_seq("high", 40, arrival=1, priority=5, first_token=100)
    scheduler.add(high)
    while high.is_prefill or high.num_computed_tokens == 0:
        out = run_step(scheduler)
        assert scheduled(out)[0] == (low.seq_id, 1)
        assert out.num_batched_tokens <= 10


def test_prefill_chunks_are_capped_per_sequence():
    scheduler = make_scheduler(budget=100, cap=4)
    a, b = make_seq("a", 10), make_seq("b", 10, arrival=1, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduled(run_step(scheduler)) == [(a.seq_id, 4), (b.seq_id, 4)]
    assert scheduled(run_step(scheduler)) == [(a.seq_id, 4), (b.seq_id, 4)]
    assert scheduled(run_step(scheduler)) == [(a.seq_id, 2), (b.seq_id, 2)]  # both sample now
    assert scheduled(run_step(scheduler)) == [(a.seq_id, 1), (b.seq_id, 1)]


@pytest.mark.parametrize("seed", range(40))
def test_decodes_first_and_capped_chunks_over_random_workloads(seed):
    """Random arrivals, priorities, lengths, pools, policies, modes, caps and watermarks: each
    step, every decode that was running when the step began (and was not preempted) gets its
    token, every decode chunk comes before every prefill chunk, no prefill chunk exceeds the
    cap, the budget holds, no more than max_num_seqs sequences run (after the step's forks of
    n / best_of samples, and after its output), and every request finishes."""
    import random

    rng = random.Random(seed)
    max_num_seqs = rng.randint(1, 6)
    cap = rng.choice([0, 1, 3, 8])
    scheduler = make_scheduler(num_blocks=rng.randint(8, 40), block_size=rng.choice([1, 2, 4]),
                               budget=rng.randint(max_num_seqs, 40), mode=rng.choice(["recompute", "swap"]),
                               policy=rng.choice(["priority", "fcfs", "longest", "shortest_remaining", "recompute_cost"]),
                               cpu_blocks=rng.randint(0, 30), max_num_seqs=max_num_seqs,
                               watermark=rng.choice([0.0, 0.1, 0.25]), cap=cap)
    arrivals = sorted((rng.randint(0, 30), i) for i in range(rng.randint(1, 12)))
    seqs = []
    for step in range(2000):
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            seq = make_seq(f"r{i}", rng.randint(1, 20), arrival=step + i / 100, priority=rng.randint(0, 3),
                           max_tokens=rng.randint(1, 12), first_token=rng.choice([10, 10 * (i + 2)]),
                           best_of=rng.choice([1, 1, rng.randint(1, max_num_seqs)]))
            scheduler.add(seq)
            seqs.append(seq)
        if not arrivals and not scheduler.num_unfinished:
            break
        decodes = {s.seq_id for s in scheduler.running if not s.is_prefill}
        out = scheduler.schedule()
        gone = set(out.preempted_seq_ids) | set(out.finished_seq_ids)
        gone |= {s.seq_id for seq in seqs for s in seq.request.seqs if s.status is SequenceStatus.SWAPPED}
        chunks = {c.seq_id: c.num_tokens for c in out.chunks}
        assert decodes - gone <= set(chunks), "a running decode got no token"
        kinds = [c.seq_id in decodes for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk came before a decode"
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        if cap:
            assert all(n <= cap for sid, n in chunks.items() if sid not in decodes)
        assert len(scheduler.running) <= max_num_seqs, f"{len(scheduler.running)} running, max_num_seqs={max_num_seqs}"
        scheduler.update_from_output(ModelRunnerOutput(runner_tokens(out)), finish_at_max_tokens)
        assert len(scheduler.running) <= max_num_seqs
        scheduler.block_manager.check_invariants()
    assert all(s.finished for seq in seqs for s in seq.request.seqs) and not arrivals, "a request never finished"


# ---- preemption: policies and the watermark (issue 31, item 2) ------------------------------------
def two_admissions(policy: str, scenario: str):
    """Two sequences admitted in different steps filling a 4-block pool; at the third step the
    one admitted second needs a block. A: the later arrival (high priority) is admitted first;
    B: the earlier arrival (low priority) is admitted first, the later one after it."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=8, policy=policy)
    early = make_seq("early", 8 if scenario == "B" else 4, arrival=0, priority=0)
    late = make_seq("late", 8 if scenario == "A" else 4, arrival=1, priority=5, first_token=100)
    if scenario == "A":
        scheduler.add(late)
        scheduler.add(early)  # waits a step: late takes the whole budget
        run_step(scheduler)
    else:
        scheduler.add(early)
        run_step(scheduler)
        scheduler.add(late)
    run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0
    return scheduler, early, late


@pytest.mark.parametrize("scenario, policy, victim", [
    ("A", "fcfs", "early"), ("B", "fcfs", "late"),  # the latest admitted, whatever its arrival
    ("A", "priority", "early"), ("B", "priority", "early"),  # the lowest priority
])
def test_fcfs_preempts_the_latest_admitted(scenario, policy, victim):
    scheduler, early, late = two_admissions(policy, scenario)
    out = run_step(scheduler)
    assert out.preempted_seq_ids == [{"early": early, "late": late}[victim].seq_id]
    scheduler.block_manager.check_invariants()


def three_in_a_full_pool(policy: str, lengths: list[int]):
    """Three sequences with these prompt lengths (arrivals 0, 1, 2; distinct tokens) in a 6-block
    pool of 4-token blocks that they fill; the next step's first decode to cross a block preempts."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=100, policy=policy)
    seqs = [make_seq(f"s{i}", n, arrival=i, max_tokens=50, first_token=100 * (i + 1)) for i, n in enumerate(lengths)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0
    return scheduler, seqs


@pytest.mark.parametrize("policy, victim", [("longest", 1), ("priority", 2)])
def test_longest_preempts_the_sequence_holding_most_tokens(policy, victim):
    scheduler, seqs = three_in_a_full_pool(policy, [3, 12, 7])  # 1 + 3 + 2 blocks; s1 needs a 4th
    out = run_step(scheduler)
    assert out.preempted_seq_ids == [seqs[victim].seq_id]


@pytest.mark.parametrize("policy, victim", [("recompute_cost", 0), ("priority", 2)])
def test_recompute_cost_preempts_the_cheapest_recompute_per_block_freed(policy, victim):
    """s0 (8 computed, both blocks in the prefix cache) loses nothing; s1 (5 computed, one cached
    block) would recompute 1 token per 2 blocks freed, s2 (7 computed) 3 per 2."""
    scheduler, seqs = three_in_a_full_pool(policy, [8, 5, 7])
    costs = [scheduler._recompute_cost(seq) for seq in seqs]
    assert costs == [0.0, 0.5, 1.5]
    out = run_step(scheduler)  # s0's 9th token needs a third block
    assert out.preempted_seq_ids == [seqs[victim].seq_id]


def test_recompute_cost_differs_from_the_designs_longest_cached_prefix():
    """Design 001 Algorithm 8 preempts MAX(prefix_cache_length); we preempt the cheapest recompute
    per block freed (docs/engine.md, "Preemption"). Here the rules disagree: s0 holds the longest
    cached prefix (8 tokens) but would recompute its 9th token over 3 blocks; s1 (4 tokens, all
    cached) recomputes nothing, and it is the victim (the sequence asking: it preempts itself)."""
    scheduler, seqs = three_in_a_full_pool("recompute_cost", [9, 4, 7])  # 3 + 1 + 2 blocks; s1 needs a 2nd
    bm = scheduler.block_manager
    cached = [sum(bm.content[b] is not None for b in bm.block_table(seq.seq_id)) * bm.block_size for seq in seqs]
    assert cached == [8, 4, 4]  # the design's rule would take s0
    assert [scheduler._recompute_cost(seq) for seq in seqs] == [1 / 3, 0.0, 1.5]
    out = run_step(scheduler)
    assert out.preempted_seq_ids == [seqs[1].seq_id]
    assert {c.seq_id for c in out.chunks} == {seqs[0].seq_id, seqs[2].seq_id}


def test_recompute_cost_of_a_sequence_that_frees_nothing_is_infinite():
    scheduler = make_scheduler()
    seq = make_seq("a", 6, max_tokens=3)
    scheduler.add(seq)
    run_step(scheduler)
    scheduler.block_manager.fork(seq.seq_id, 999)  # another holder of every block
    assert scheduler._recompute_cost(seq) == float("inf")


def test_admission_leaves_the_watermark_free_while_something_runs():
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=100, watermark=0.2)  # 2 blocks
    assert scheduler.watermark_blocks == 2
    big = make_seq("big", 24, arrival=0)  # 6 blocks, admitted alone: nothing else runs
    scheduler.add(big)
    run_step(scheduler)
    small = make_seq("small", 8, arrival=1, first_token=100)  # would leave 10 - 7 - 2 = 1 free
    scheduler.add(small)
    out = run_step(scheduler)
    assert scheduled(out) == [(big.seq_id, 1)] and small.status is SequenceStatus.WAITING
    alone = make_scheduler(num_blocks=10, block_size=4, budget=100, watermark=0.2)
    whole = make_seq("whole", 39)  # 10 blocks: with nothing running, the watermark does not block it
    alone.add(whole)
    assert scheduled(run_step(alone)) == [(whole.seq_id, 39)]


def test_a_step_that_starts_under_the_watermark_preempts_before_scheduling():
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=100, watermark=0.2)
    a, b = make_seq("a", 16, arrival=0), make_seq("b", 15, arrival=1, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # 4 + 4 blocks: 2 free, as the watermark asks
    run_step(scheduler)  # a's 17th position takes a fifth block: 1 free
    assert scheduler.block_manager.num_free_blocks == 1
    out = run_step(scheduler)
    assert out.preempted_seq_ids == [b.seq_id] and scheduled(out) == [(a.seq_id, 1)]
    assert scheduler.block_manager.num_free_blocks >= 2
    for _ in range(3):  # the last running sequence is never preempted by the watermark
        assert run_step(scheduler).preempted_seq_ids == []
    scheduler.block_manager.check_invariants()


# ---- cases found by mutation testing (issue 45, `make mutate`) --------------------------------------
def spec_scheduler(method: str = "ngram", k: int = 3, budget: int = 64, mode: str = "recompute", num_blocks: int = 64,
                   disable_by_batch_size: int | None = None, **planner) -> Scheduler:
    """A scheduler whose planner verifies up to k proposals per decode (a draft model's also reserve
    k lookahead slots and keep their KV in the same blocks)."""
    from pagedllm.config.speculative import SpeculativeConfig
    from pagedllm.step.planner import StepPlanner

    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model="draft" if method == "draft_model" else None,
                             disable_by_batch_size=disable_by_batch_size)
    config = SchedulerConfig(16, budget, 4096, True, mode, "priority")
    bm = BlockManager(num_blocks, 4, 64 if mode == "swap" else 0)
    return Scheduler(config, bm, planner=StepPlanner(max_model_len=4096, speculation=spec, **planner))


def tokens(*ids: int) -> list[SampledToken]:
    return [SampledToken(t, 0.0) for t in ids]


def test_verified_proposals_advance_by_the_accepted_ones_and_are_counted():
    scheduler = spec_scheduler()
    a = make_seq("a", 6, max_tokens=50)
    scheduler.add(a)
    scheduler.schedule()
    changed = scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7)},
                                                             spec_token_ids={a.seq_id: [8, 9, 10]}), lambda s, t: None)
    assert changed == [a] and a.spec_token_ids == [8, 9, 10] and a.num_computed_tokens == 6
    out = scheduler.schedule()
    assert scheduled(out) == [(a.seq_id, 4)] and out.chunks[0].max_proposals == 3
    # two proposals accepted, the third replaced: 1 + 2 positions computed, three tokens appended
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(8, 9, 11)}, spec_token_ids={a.seq_id: [12]}),
                                 lambda s, t: None)
    assert a.num_computed_tokens == 9 and a.token_ids[6:] == [7, 8, 9, 11] and a.spec_token_ids == [12]
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_position) == (1, 3, 2, [1, 1, 0])
    assert scheduled(scheduler.schedule()) == [(a.seq_id, 2)]
    # none accepted (one token back), and a fused cycle's own counts
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(13)}, spec_cycles={a.seq_id: [(2, 2), (3, 1)]}),
                                 lambda s, t: None)
    assert a.num_computed_tokens == 10 and a.spec_token_ids == []
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_position) == (4, 9, 5, [3, 2, 0])


def two_decodes_with_three_proposals(budget: int):
    """A speculating scheduler with the step `budget` and two running decodes, a and b, each
    holding three proposals for its next step."""
    scheduler = spec_scheduler(budget=budget)
    a, b = make_seq("a", 2, max_tokens=50), make_seq("b", 2, arrival=1, first_token=100, max_tokens=50)
    for seq in (a, b):
        scheduler.add(seq)
    scheduler.schedule()
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7), b.seq_id: tokens(7)},
                                                   spec_token_ids={a.seq_id: [1, 2, 3], b.seq_id: [4, 5, 6]}), lambda s, t: None)
    return scheduler, a, b


def test_proposals_verified_are_bounded_by_the_budget_left_for_later_decodes():
    """budget 4, two decodes with three proposals each: the first verifies 4 - 1 - 1 (one token
    kept for the second) = 2, the second what is left: 4 - 3 - 1 = 0."""
    scheduler, a, b = two_decodes_with_three_proposals(budget=4)
    out = scheduler.schedule()
    assert scheduled(out) == [(a.seq_id, 3), (b.seq_id, 1)]
    assert [item.num_spec for item in scheduler._records[-1].scheduled] == [2, 0]
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(1, 9), b.seq_id: tokens(9)}), lambda s, t: None)
    assert (a.num_computed_tokens, b.num_computed_tokens) == (2 + 1 + 1, 3)
    assert scheduler.spec_stats.num_draft_tokens == 2 and scheduler.spec_stats.num_accepted_tokens == 1


def test_a_draft_models_blocks_are_published_when_both_models_computed_them():
    """With a draft model a decode reserves k lookahead slots, and a block enters the prefix cache
    only when the draft's KV is in it too (num_draft_computed, from the runner)."""
    scheduler = spec_scheduler("draft_model", k=2)
    bm = scheduler.block_manager
    a = make_seq("a", 8, max_tokens=50)
    scheduler.add(a)
    scheduler.schedule()
    assert len(bm.block_table(a.seq_id)) == 2
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7)}, draft_computed={a.seq_id: 4}), lambda s, t: None)
    assert a.num_draft_computed == 4
    assert [bm.content[b] is not None for b in bm.block_table(a.seq_id)] == [True, False]
    scheduler.schedule()  # the decode: 1 position + 2 lookahead slots -> a third block
    assert len(bm.block_table(a.seq_id)) == 3
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7)}), lambda s, t: None)
    assert a.num_draft_computed == 4  # unchanged when the runner says nothing
    scheduler.schedule()
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7)}, draft_computed={a.seq_id: 9}), lambda s, t: None)
    assert [bm.content[b] is not None for b in bm.block_table(a.seq_id)[:2]] == [True, True]


def test_a_sequence_ended_before_its_output_takes_nothing_and_others_still_advance():
    scheduler = make_scheduler()
    a, b = make_seq("a", 4), make_seq("b", 4, arrival=1, first_token=100)
    for seq in (a, b):
        scheduler.add(seq)
    scheduler.schedule()
    scheduler.finish(a, SequenceStatus.FINISHED_ABORTED)  # ended while its step ran
    changed = scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7), b.seq_id: tokens(8)}), lambda s, t: None)
    assert changed == [b] and a.token_ids == list(range(10, 14)) and b.token_ids[-1] == 8 and b.num_computed_tokens == 4


def test_a_step_stops_at_a_block_bound_per_step():
    """max_step_blocks (layer-wise KV offload's device buffer) bounds the blocks one step's
    sequences use: the second prompt waits, then runs when the first is done."""
    bm = BlockManager(64, 4, 0)
    scheduler = Scheduler(SchedulerConfig(16, 100, 4096, True, "recompute", "priority", max_step_blocks=4), bm)
    a, b = make_seq("a", 12, max_tokens=1), make_seq("b", 8, arrival=1, first_token=100, max_tokens=1)
    for seq in (a, b):
        scheduler.add(seq)
    out = run_step_with(scheduler, finish_at_max_tokens)
    assert scheduled(out) == [(a.seq_id, 12)] and b.status is SequenceStatus.WAITING  # 3 + 2 blocks > 4
    assert a.finished
    assert scheduled(run_step_with(scheduler, finish_at_max_tokens)) == [(b.seq_id, 8)]
    assert scheduler.capacity_blocks == 4
    too_long = make_seq("c", 17, arrival=2, first_token=200)  # 5 blocks: more than one step holds
    scheduler.add(too_long)
    out = scheduler.schedule()
    assert too_long.status is SequenceStatus.FINISHED_LENGTH and out.finished_seq_ids == [b.seq_id, too_long.seq_id]


def run_step_with(scheduler: Scheduler, on_token):
    out = scheduler.schedule()
    scheduler.update_from_output(ModelRunnerOutput(runner_tokens(out)), on_token)
    return out


def test_a_prompt_too_long_for_the_pool_ends_and_the_next_is_admitted_in_the_same_step():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=100)
    too_long, fits = make_seq("long", 17, arrival=0), make_seq("fits", 4, arrival=1, first_token=100)
    for seq in (too_long, fits):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert too_long.status is SequenceStatus.FINISHED_LENGTH and scheduled(out) == [(fits.seq_id, 4)]
    assert scheduler._ended == [too_long]


def test_the_last_token_of_the_budget_admits_a_one_token_chunk():
    scheduler = make_scheduler(budget=5)
    a, b = make_seq("a", 4), make_seq("b", 9, arrival=1, first_token=100)
    for seq in (a, b):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert scheduled(out) == [(a.seq_id, 4), (b.seq_id, 1)]


def test_prompt_logprobs_bypass_the_prefix_cache_and_ask_for_each_position_once():
    scheduler = make_scheduler(budget=6)
    first = make_seq("first", 8)
    scheduler.add(first)
    run_step(scheduler)
    run_step(scheduler)
    request = Request("scored", None, list(range(10, 18)), SamplingParams(max_tokens=4, prompt_logprobs=2), 1.0)
    scored = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(scored)
    scheduler.add(scored)
    out = scheduler.schedule()
    assert request.num_cached_tokens == 0 and scored.num_computed_tokens == 0  # same prompt, no cache hit
    chunk = next(c for c in out.chunks if c.seq_id == scored.seq_id)
    assert chunk.num_tokens == 5 and chunk.prompt_logprobs.num == 2
    assert (chunk.prompt_logprobs.start, chunk.prompt_logprobs.targets) == (0, list(range(11, 16)))
    entries = {scored.seq_id: [SampledToken(t, -1.0) for t in range(11, 16)]}
    scheduler.update_from_output(ModelRunnerOutput(runner_tokens(out), prompt_logprobs=entries), lambda s, t: None)
    request.prompt_logprobs += [{} for _ in range(5)]  # what the output processor records
    out = scheduler.schedule()
    chunk = next(c for c in out.chunks if c.seq_id == scored.seq_id)
    assert (chunk.prompt_logprobs.start, chunk.prompt_logprobs.targets) == (5, [16, 17])  # up to the last prompt token
    cached = make_seq("cached", 8, arrival=2)  # the same prompt without prompt_logprobs hits the cache
    scheduler.add(cached)
    scheduler.schedule()
    assert cached.request.num_cached_tokens == 4 and cached.num_computed_tokens == 4


def test_num_cached_tokens_reports_the_prefix_hit_and_fcfs_keeps_the_first_admission_index():
    scheduler = make_scheduler(budget=100, policy="fcfs")
    a = make_seq("a", 9)
    scheduler.add(a)
    run_step(scheduler)
    b, c = make_seq("b", 9, arrival=1), make_seq("c", 9, arrival=2)
    for seq in (b, c):
        scheduler.add(seq)
    run_step(scheduler)
    assert (b.request.num_cached_tokens, c.request.num_cached_tokens) == (8, 8)
    assert [s.request.admission_index for s in (a, b, c)] == [0, 1, 2]
    assert scheduler.block_manager.prefix_cache_queries == 27 and scheduler.block_manager.prefix_cache_hits == 16
    from pagedllm.engine.scheduler import _Step

    scheduler.running.remove(a)
    scheduler._preempt(a, _Step())  # as the watermark would
    run_step(scheduler)
    assert a.status is SequenceStatus.RUNNING and a.request.admission_index == 0  # kept across the preemption


def greedy_seq(name: str, prompt_len: int, arrival: float = 0.0, max_tokens: int = 16, first_token: int = 10) -> Sequence:
    request = Request(name, None, list(range(first_token, first_token + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, temperature=0), arrival)
    seq = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    return seq


def planned_scheduler(num_blocks: int = 64, **planner) -> Scheduler:
    from pagedllm.step.planner import StepPlanner

    config = SchedulerConfig(16, 64, 4096, True, "recompute", "priority")
    return Scheduler(config, BlockManager(num_blocks, 4, 0), planner=StepPlanner(max_model_len=4096, **planner))


def test_greedy_decodes_run_as_a_burst_with_their_positions_reserved():
    """num_scheduler_steps=4: once both decode (nothing waiting), each gets 4 tokens' budget and
    blocks for 4 positions; the runner's 4 tokens advance each by 4. A pool that cannot reserve
    them falls back to one token."""
    scheduler = planned_scheduler(num_scheduler_steps=4)
    a, b = greedy_seq("a", 3), greedy_seq("b", 5, arrival=1, first_token=100)
    for seq in (a, b):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [c.token_budget for c in out.chunks] == [1, 1]  # prompts: no burst
    scheduler.update_from_output(ModelRunnerOutput(runner_tokens(out)), lambda s, t: None)
    out = scheduler.schedule()
    assert [(c.num_tokens, c.token_budget) for c in out.chunks] == [(1, 4), (1, 4)]
    bm = scheduler.block_manager
    assert [len(bm.block_table(s.seq_id)) for s in (a, b)] == [2, 3]  # positions 3..6 and 5..8
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(1, 2, 3, 4), b.seq_id: tokens(5, 6, 7, 8)}),
                                 lambda s, t: None)
    assert (a.num_computed_tokens, b.num_computed_tokens) == (7, 9) and a.token_ids[-4:] == [1, 2, 3, 4]
    assert bm.content[bm.block_table(b.seq_id)[1]] is not None  # a burst's positions are published too
    small = planned_scheduler(num_blocks=3, num_scheduler_steps=4)
    c = greedy_seq("c", 6)
    small.add(c)
    run_step(small)
    out = small.schedule()  # positions 6..9 fit the 3 blocks; 10..13 would need a fourth
    assert out.chunks[0].token_budget == 4
    small.update_from_output(ModelRunnerOutput({c.seq_id: tokens(1, 2, 3, 4)}), lambda s, t: None)
    out = small.schedule()
    assert out.chunks[0].token_budget == 1 and len(small.block_manager.block_table(c.seq_id)) == 3
    waiting = planned_scheduler(num_scheduler_steps=4)
    d = greedy_seq("d", 3)
    waiting.add(d)
    run_step(waiting)
    waiting.add(greedy_seq("e", 3, arrival=1, first_token=100))
    assert [ch.token_budget for ch in waiting.schedule().chunks] == [1, 1]  # something was admitted: single steps


class FakeGrammar:
    """A grammar accepting `allowed` tokens, stopped after `length` of them."""

    def __init__(self, allowed: set[int], length: int):
        self.allowed, self.length, self.consumed = allowed, length, []

    def consume_token(self, token: int) -> bool:
        if token not in self.allowed:
            return False
        self.consumed.append(token)
        return True

    def is_stopped(self) -> bool:
        return len(self.consumed) >= self.length

    def get_error(self) -> str:
        return "not allowed"

    def deep_copy(self) -> "FakeGrammar":
        copy = FakeGrammar(self.allowed, self.length)
        copy.consumed = list(self.consumed)
        return copy


class FakeStructured:
    def bitmasks(self, grammars):
        return [f"mask-{len(g.consumed)}" for g in grammars]


def test_grammar_rows_get_their_masks_and_end_where_the_grammar_does():
    scheduler = Scheduler(SchedulerConfig(16, 64, 4096, True, "recompute", "priority"), BlockManager(64, 4, 0), FakeStructured())
    free, bound, wrong = make_seq("free", 3), make_seq("bound", 3, arrival=1, first_token=100), make_seq("wrong", 3, arrival=2, first_token=200)
    bound.grammar, wrong.grammar = FakeGrammar({7}, length=2), FakeGrammar({5}, length=3)
    for seq in (free, bound, wrong):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.allowed_tokens == {bound.seq_id: "mask-0", wrong.seq_id: "mask-0"}
    scheduler.update_from_output(ModelRunnerOutput(runner_tokens(out)), lambda s, t: None)  # token 7 for each
    assert bound.status is SequenceStatus.RUNNING and bound.grammar.consumed == [7]
    assert wrong.status is SequenceStatus.FINISHED_STOPPED and wrong.stop_reason == "grammar error"
    out = scheduler.schedule()
    assert out.allowed_tokens == {bound.seq_id: "mask-1"}
    scheduler.update_from_output(ModelRunnerOutput(runner_tokens(out)), lambda s, t: None)
    assert bound.status is SequenceStatus.FINISHED_STOPPED and bound.stop_reason is None
    assert free.status is SequenceStatus.RUNNING


def test_forked_samples_copy_the_grammar_and_the_parent_progress():
    scheduler = Scheduler(SchedulerConfig(16, 100, 4096, True, "recompute", "priority"), BlockManager(64, 4, 0), FakeStructured())
    parent = make_seq("p", 6, best_of=3)
    parent.grammar = FakeGrammar({7}, length=5)
    scheduler.add(parent)
    out = scheduler.schedule()
    children = parent.request.seqs[1:]
    assert [c.index for c in children] == [1, 2] and all(c.num_computed_tokens == 6 for c in children)
    assert all(c.grammar is not parent.grammar and c.grammar.length == 5 for c in children)
    assert [n.forked_from for n in out.new_seqs] == [None, parent.seq_id, parent.seq_id]
    assert scheduler._records[-1].forked and parent.request.forked
    assert not scheduler.defer_last()  # a step that forked is never advanced ahead


def test_async_scheduling_advances_a_step_before_its_output_and_swaps_in_the_tokens():
    scheduler = planned_scheduler(async_scheduling=True)
    a = make_seq("a", 5, max_tokens=10)
    scheduler.add(a)
    scheduler.schedule()
    assert scheduler.defer_last() and scheduler.num_deferred_steps == 1
    assert a.num_computed_tokens == 5 and a.num_pending == 1 and a.token_ids[-1] == PENDING_TOKEN
    assert scheduler.can_schedule_ahead()
    out = scheduler.schedule()  # the next step, while the first is out (the engine's order)
    assert scheduled(out) == [(a.seq_id, 1)]
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(42)}), lambda s, t: None)
    assert a.token_ids[5:] == [42] and a.num_pending == 0 and a.num_computed_tokens == 5
    assert scheduler.defer_last() and a.num_computed_tokens == 6 and a.num_pending == 1
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(43)}), lambda s, t: None)
    assert a.token_ids[5:] == [42, 43] and not scheduler._records
    plain = planned_scheduler()
    b = make_seq("b", 5)
    plain.add(b)
    plain.schedule()
    assert not plain.defer_last() and b.num_pending == 0  # not asked for


def test_schedule_ahead_only_while_the_pool_holds_every_next_token_above_the_watermark():
    """3 blocks of 4: a sequence of 8 tokens holding 2 needs blocks_for(8 + 1) - 2 + 1 = 2 more."""
    scheduler = planned_scheduler(num_blocks=4, async_scheduling=True)
    a = make_seq("a", 7)
    scheduler.add(a)
    run_step(scheduler)  # 8 tokens in 2 blocks, 2 free
    assert scheduler.can_schedule_ahead()
    scheduler.block_manager.allocate_prefix(999, [1, 2])
    scheduler.block_manager.allocate_slots(999, 0, 2)  # one block taken: 1 free
    assert not scheduler.can_schedule_ahead()


def test_abandoned_steps_give_back_what_they_touched_and_resend_what_the_runner_missed():
    scheduler = make_scheduler(num_blocks=8, budget=100, mode="swap", secure=True)
    a, b = make_seq("a", 4), make_seq("b", 5, arrival=1, first_token=100)  # b's second block is not cached
    for seq in (a, b):
        scheduler.add(seq)
    run_step(scheduler)
    scheduler.finish(b, SequenceStatus.FINISHED_ABORTED)  # finished: the runner is told with the next step
    out = scheduler.schedule()
    assert out.finished_seq_ids == [b.seq_id] and out.blocks_to_zero
    victims, ended = scheduler.abandon_steps()
    assert victims == {a} and ended == [] and not scheduler._records
    out = scheduler.schedule()  # sent again: applying them twice is harmless
    assert out.finished_seq_ids == [b.seq_id] and out.blocks_to_zero


def test_counters_and_first_scheduled_times():
    scheduler, seqs = fill_pool("priority", mode="swap")
    assert scheduler.num_prompt_tokens_total == 24 and (scheduler.num_preemptions, scheduler.num_swap_outs) == (0, 0)
    first = {name: seq.request.metrics.first_scheduled_time for name, seq in seqs.items()}
    assert all(isinstance(t, float) and t > 0 for t in first.values())
    run_step(scheduler)  # "second" swapped out
    assert (scheduler.num_preemptions, scheduler.num_swap_outs, seqs["second"].request.num_preemptions) == (1, 1, 1)
    for _ in range(20):
        run_step(scheduler)
        if scheduler.num_preemptions == 2:
            break
    assert (scheduler.num_preemptions, scheduler.num_swap_outs) == (2, 2)
    assert sum(seq.request.num_preemptions for seq in seqs.values()) == 2
    assert {name: seq.request.metrics.first_scheduled_time for name, seq in seqs.items()} == first  # set once
    assert scheduler.num_prompt_tokens_total == 24  # counted at the first schedule only


def test_a_step_that_fails_while_scheduling_is_abandoned_with_what_it_touched():
    scheduler = planned_scheduler(num_scheduler_steps=4)
    a, b = greedy_seq("a", 3), greedy_seq("b", 3, arrival=1, first_token=100)
    for seq in (a, b):
        scheduler.add(seq)
    run_step(scheduler)

    def broken(*args):
        raise RuntimeError("planner failed")

    object.__setattr__(scheduler.planner, "burst", broken)
    with pytest.raises(RuntimeError, match="planner failed"):
        scheduler.schedule()
    assert len(scheduler._records) == 1 and scheduler._records[0].forked
    assert [item.seq for item in scheduler._records[0].scheduled] == [a, b]
    victims, ended = scheduler.abandon_steps()
    assert victims == {a, b} and ended == [] and not scheduler._records


def test_abandoning_a_step_that_swapped_out_gives_up_the_swapped_sequence():
    scheduler, seqs = fill_pool("priority", mode="swap")
    scheduler.schedule()  # "second" swapped out; the output never comes back
    assert seqs["second"].status is SequenceStatus.SWAPPED
    victims, _ = scheduler.abandon_steps()
    assert victims == set(seqs.values())


def test_a_token_outside_the_grammar_is_logged(caplog):
    scheduler = Scheduler(SchedulerConfig(16, 64, 4096, True, "recompute", "priority"), BlockManager(64, 4, 0), FakeStructured())
    wrong = make_seq("wrong", 3)
    wrong.grammar = FakeGrammar({5}, length=3)
    scheduler.add(wrong)
    with caplog.at_level("ERROR", logger="pagedllm.scheduler"):
        run_step(scheduler)
    assert caplog.messages == ["token 7 was sampled outside request wrong's grammar: not allowed"]


def test_edges_of_forks_chunks_step_blocks_deferrals_and_bursts():
    two = make_scheduler(budget=100)
    pair = make_seq("pair", 4, best_of=2)
    two.add(pair)
    two.schedule()
    assert len(pair.request.seqs) == 2  # best_of=2 forks one sample
    whole = make_scheduler(budget=8, chunked=False)
    exact = make_seq("exact", 8)
    whole.add(exact)
    assert scheduled(whole.schedule()) == [(exact.seq_id, 8)]  # a prompt exactly the budget runs unchunked
    bound = Scheduler(SchedulerConfig(16, 100, 4096, True, "recompute", "priority", max_step_blocks=5), BlockManager(64, 4, 0))
    a, b = make_seq("a", 12), make_seq("b", 8, arrival=1, first_token=100)
    for seq in (a, b):
        bound.add(seq)
    assert scheduled(bound.schedule()) == [(a.seq_id, 12), (b.seq_id, 8)]  # 3 + 2 blocks: exactly the bound
    deferring = planned_scheduler(async_scheduling=True)
    c = make_seq("c", 4)
    deferring.add(c)
    for _ in range(2):
        deferring.schedule()
        deferring.defer_last()
        deferring.update_from_output(ModelRunnerOutput({c.seq_id: tokens(7)}), lambda s, t: None)
    assert deferring.num_deferred_steps == 2
    pairs = planned_scheduler(num_scheduler_steps=2)
    d = greedy_seq("d", 3)
    pairs.add(d)
    run_step(pairs)
    assert [ch.token_budget for ch in pairs.schedule().chunks] == [2]


def test_a_recomputed_prompt_reports_only_the_positions_not_reported_yet():
    scheduler = make_scheduler(budget=5)
    request = Request("scored", None, list(range(10, 18)), SamplingParams(max_tokens=4, prompt_logprobs=1), 0.0)
    seq = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    scheduler.add(seq)
    out = scheduler.schedule()
    assert out.chunks[0].prompt_logprobs.targets == [11, 12, 13, 14, 15]
    scheduler.update_from_output(ModelRunnerOutput({}), lambda s, t: None)
    request.prompt_logprobs += [{} for _ in range(5)]
    from pagedllm.engine.scheduler import _Step

    scheduler.running.remove(seq)
    scheduler._preempt(seq, _Step())  # recompute: from position 0 again
    out = scheduler.schedule()
    assert out.chunks[0].num_tokens == 5 and out.chunks[0].prompt_logprobs is None  # positions 0..4 were reported
    scheduler.update_from_output(ModelRunnerOutput({}), lambda s, t: None)
    out = scheduler.schedule()
    assert (out.chunks[0].prompt_logprobs.start, out.chunks[0].prompt_logprobs.targets) == (5, [16, 17])


def test_a_swapped_in_sequence_decodes_in_the_same_step():
    scheduler, seqs = fill_pool("priority", mode="swap")
    run_step(scheduler)  # "second" swapped out
    victim = seqs["second"]
    scheduler.finish(seqs["first"], SequenceStatus.FINISHED_ABORTED)
    newcomer = make_seq("newcomer", 3, arrival=5, first_token=300)
    scheduler.add(newcomer)
    out = run_step(scheduler)
    assert victim.status is SequenceStatus.RUNNING and len(out.blocks_to_swap_in) == 2
    assert scheduled(out) == [(seqs["third"].seq_id, 1), (victim.seq_id, 1)]  # the pool is full again: newcomer waits
    assert victim.num_computed_tokens == 9 and victim.token_ids[-1] == 7 and newcomer.status is SequenceStatus.WAITING


# ---- more cases found by mutation testing (issue 45 item 1: every survivor killed or justified) ------
def swap_out(scheduler: Scheduler, seq: Sequence) -> None:
    """Preempt `seq` as the scheduler would (swap mode: to host memory; recompute: back to waiting)."""
    from pagedllm.engine.scheduler import _Step

    scheduler.running.remove(seq)
    scheduler._preempt(seq, _Step())


def swapped_out_with_proposals(scheduler: Scheduler, seq: Sequence, proposals: list[int]) -> None:
    """Admit `seq`, give it its first token (7) and `proposals`, then swap it out."""
    scheduler.add(seq)
    scheduler.schedule()
    scheduler.update_from_output(ModelRunnerOutput({seq.seq_id: tokens(7)}, spec_token_ids={seq.seq_id: proposals}),
                                 lambda s, t: None)
    swap_out(scheduler, seq)


def lora_seq(name: str, prompt_len: int, lora_id: int, arrival: float, first_token: int) -> Sequence:
    from pagedllm.lora.request import LoRARequest

    seq = make_seq(name, prompt_len, arrival=arrival, first_token=first_token)
    seq.request.lora_request = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    return seq


def test_running_adapters_stay_within_max_loras_and_the_base_model_is_not_one():
    """max_loras=1: an adapter already running, and the base model, are admitted beside it; a
    second adapter waits — without holding back the requests behind it — until the first is gone."""
    scheduler = make_scheduler(budget=100, max_loras=1)
    one, two = lora_seq("one", 4, 1, 0, 100), lora_seq("two", 4, 2, 1, 200)
    one_again, base = lora_seq("one-again", 4, 1, 2, 300), lora_seq("base", 4, 0, 3, 400)
    for seq in (one, two, one_again, base):
        scheduler.add(seq)
    assert scheduled(run_step(scheduler)) == [(one.seq_id, 4), (one_again.seq_id, 4), (base.seq_id, 4)]
    assert two.status is SequenceStatus.WAITING
    scheduler.finish(one, SequenceStatus.FINISHED_STOPPED)
    assert two.seq_id not in {c.seq_id for c in run_step(scheduler).chunks}  # adapter 1 still runs
    scheduler.finish(one_again, SequenceStatus.FINISHED_STOPPED)
    assert (two.seq_id, 4) in scheduled(run_step(scheduler))


def test_the_prefix_cache_is_per_adapter():
    scheduler = make_scheduler(budget=100, max_loras=2)
    first = lora_seq("first", 9, 1, 0, 10)
    scheduler.add(first)
    run_step(scheduler)
    other, same = lora_seq("other", 9, 2, 1, 10), lora_seq("same", 9, 1, 2, 10)
    for seq in (other, same):
        scheduler.add(seq)
    run_step(scheduler)
    assert (other.request.num_cached_tokens, same.request.num_cached_tokens) == (0, 8)


def test_shortest_remaining_ranks_by_tokens_left_to_max_tokens():
    """Victims come from the end of the keep order: the sequence closest to its max_tokens (its
    outputs counted), whatever its priority; no max_tokens counts as max_model_len."""
    scheduler = make_scheduler(policy="shortest_remaining")
    near = make_seq("near", 4, arrival=0, priority=5, max_tokens=10)
    near.token_ids += [7] * 8  # 2 left
    far = make_seq("far", 4, arrival=1, max_tokens=6)
    far.token_ids += [7]  # 5 left
    unbounded = make_seq("unbounded", 4, arrival=2, max_tokens=None)
    assert sorted([near, far, unbounded], key=scheduler._keep_key) == [unbounded, far, near]


def test_recompute_cost_of_a_block_not_in_the_prefix_cache():
    scheduler = make_scheduler()
    seq = make_seq("a", 3)
    scheduler.add(seq)
    run_step(scheduler)  # 3 computed in a block not full, so not cached: all of them are lost
    assert scheduler._recompute_cost(seq) == 3.0


def test_the_watermark_never_preempts_the_only_running_sequence():
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=100, watermark=0.2)
    alone = make_seq("alone", 35, max_tokens=4)  # 9 blocks once it samples: 1 free, under the watermark of 2
    scheduler.add(alone)
    run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 1
    out = run_step(scheduler)
    assert out.preempted_seq_ids == [] and scheduled(out) == [(alone.seq_id, 1)]


def test_a_swapped_sequence_comes_back_only_with_budget_and_then_spends_it():
    """Budget 3: a decode and a prompt chunked 2 at a time spend it, so the swapped sequence waits
    (nothing swapped in to sit idle); once the prompt decodes, the one token left brings it back,
    and the waiting prompt behind it gets nothing."""
    scheduler = make_scheduler(budget=3, mode="swap")
    a, s = make_seq("a", 1, arrival=0), make_seq("s", 1, arrival=1, first_token=100)
    p = make_seq("p", 9, arrival=2, first_token=200)
    for seq in (a, s, p):
        scheduler.add(seq)
    assert scheduled(run_step(scheduler)) == [(a.seq_id, 1), (s.seq_id, 1), (p.seq_id, 1)]
    swap_out(scheduler, s)
    w = make_seq("w", 4, arrival=3, first_token=300)
    scheduler.add(w)
    for _ in range(4):
        out = run_step(scheduler)
        assert scheduled(out) == [(a.seq_id, 1), (p.seq_id, 2)]
        assert s.status is SequenceStatus.SWAPPED and out.blocks_to_swap_in == []
    out = run_step(scheduler)  # p decodes now
    assert scheduled(out) == [(a.seq_id, 1), (p.seq_id, 1), (s.seq_id, 1)] and len(out.blocks_to_swap_in) == 1
    assert w.status is SequenceStatus.WAITING


def test_a_swap_in_leaves_its_budget_to_the_waiting_prompts():
    scheduler = make_scheduler(budget=10, mode="swap")
    s = make_seq("s", 3)
    scheduler.add(s)
    run_step(scheduler)
    swap_out(scheduler, s)
    w = make_seq("w", 20, arrival=1, first_token=100)
    scheduler.add(w)
    assert scheduled(run_step(scheduler)) == [(s.seq_id, 1), (w.seq_id, 9)]


def test_a_swap_in_needs_only_the_blocks_its_tokens_fill():
    """A sequence of 7 tokens (6 computed) swapped out of a 2-block pool comes back into exactly
    those 2 free blocks: its next position is in its last block."""
    scheduler = make_scheduler(num_blocks=2, block_size=4, budget=100, mode="swap")
    s = make_seq("s", 6)
    scheduler.add(s)
    run_step(scheduler)
    swap_out(scheduler, s)
    assert scheduler.block_manager.num_free_blocks == 2
    out = run_step(scheduler)
    assert s.status is SequenceStatus.RUNNING and scheduled(out) == [(s.seq_id, 1)]


def test_a_swapped_sequence_too_long_for_the_pool_ends_and_the_next_one_comes_back():
    scheduler = make_scheduler(num_blocks=3, block_size=4, budget=100, mode="swap")
    long, short = make_seq("long", 7, arrival=0), make_seq("short", 3, arrival=1, first_token=100)
    for seq in (long, short):
        scheduler.add(seq)
    run_step(scheduler)
    swap_out(scheduler, long)
    swap_out(scheduler, short)
    long.token_ids += [7] * 5  # 13 tokens: 4 blocks, more than the pool
    out = run_step(scheduler)
    assert long.status is SequenceStatus.FINISHED_LENGTH and out.finished_seq_ids == [long.seq_id]
    assert short.status is SequenceStatus.RUNNING and scheduled(out) == [(short.seq_id, 1)]


def test_a_swapped_in_decode_verifies_its_proposals():
    """Budget 4: the swapped-in decode verifies all 3 proposals (nothing is kept for later
    decodes), and advances by the accepted ones."""
    scheduler = spec_scheduler(budget=4, mode="swap")
    a = make_seq("a", 4, max_tokens=50)
    swapped_out_with_proposals(scheduler, a, [8, 9, 10])
    out = scheduler.schedule()
    assert a.status is SequenceStatus.RUNNING and scheduled(out) == [(a.seq_id, 4)]
    assert [item.num_spec for item in scheduler._records[-1].scheduled] == [3]
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(8, 9, 11)}), lambda s, t: None)
    assert a.num_computed_tokens == 4 + 1 + 2 and a.token_ids[4:] == [7, 8, 9, 11]


def test_a_swapped_in_draft_model_decode_reserves_its_lookahead_slots():
    scheduler = spec_scheduler("draft_model", k=2, mode="swap")
    a = make_seq("a", 8, max_tokens=50)
    swapped_out_with_proposals(scheduler, a, [1, 2])
    out = scheduler.schedule()
    assert scheduled(out) == [(a.seq_id, 3)]
    assert len(scheduler.block_manager.block_table(a.seq_id)) == 4  # positions 8..12: 3 to compute, 2 lookahead


def test_a_swapped_in_decode_without_room_for_its_proposals_verifies_none():
    """A 2-block pool: the swapped-in sequence (8 tokens, 7 computed) gets its 2 blocks back, but
    its 3 proposals would need a third: it decodes its one token instead."""
    scheduler = spec_scheduler(mode="swap", num_blocks=2)
    a = make_seq("a", 7, max_tokens=50)
    swapped_out_with_proposals(scheduler, a, [1, 2, 3])
    out = scheduler.schedule()
    assert scheduled(out) == [(a.seq_id, 1)] and [item.num_spec for item in scheduler._records[-1].scheduled] == [0]
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(9)}), lambda s, t: None)
    assert a.num_computed_tokens == 8 and a.token_ids[-2:] == [7, 9]


def test_the_step_block_bound_counts_every_scheduled_sequence():
    """max_step_blocks=5: three decodes crossing into their second block need 6, so the third
    waits a step (keeping its blocks); three 2-block prompts, likewise the third."""
    scheduler = make_scheduler(budget=100, max_step_blocks=5)
    seqs = [make_seq(f"s{i}", 3, arrival=i, first_token=100 * (i + 1)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler)
    assert scheduled(run_step(scheduler)) == [(s.seq_id, 1) for s in seqs]  # position 3: one block each
    out = run_step(scheduler)  # position 4: a second block each
    assert scheduled(out) == [(seqs[0].seq_id, 1), (seqs[1].seq_id, 1)] and seqs[2].status is SequenceStatus.RUNNING
    admissions = make_scheduler(budget=100, max_step_blocks=5)
    prompts = [make_seq(f"p{i}", 8, arrival=i, first_token=100 * (i + 1)) for i in range(3)]
    for seq in prompts:
        admissions.add(seq)
    assert scheduled(admissions.schedule()) == [(prompts[0].seq_id, 8), (prompts[1].seq_id, 8)]
    assert prompts[2].status is SequenceStatus.WAITING


def test_preemptions_are_counted_per_request_and_the_runner_gets_the_sequence_again():
    """A recompute preemption drops the sequence's KV on the runner too: it is sent whole again
    when readmitted. The mirror forgets finished sequences (a server would otherwise keep every
    request's table)."""
    scheduler = make_scheduler()
    a = make_seq("a", 4)
    scheduler.add(a)
    for _ in range(2):
        run_step(scheduler)
        swap_out(scheduler, a)  # recompute mode: back to waiting
        out = run_step(scheduler)
        assert [new.seq_id for new in out.new_seqs] == [a.seq_id] and out.updates == []
    assert a.request.num_preemptions == 2 and scheduler.num_preemptions == 2
    assert scheduler.live[a.seq_id] is a
    scheduler.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.seq_id not in scheduler.mirror._sent and a.seq_id not in scheduler.live


def test_abandoned_steps_resend_every_preemption_and_finish():
    """Two steps out, the first preempting "second", and "third" finished meanwhile: after they
    are abandoned, the next step tells the runner of both."""
    scheduler, seqs = fill_pool("priority")
    assert scheduler.schedule().preempted_seq_ids == [seqs["second"].seq_id]
    scheduler.schedule()  # scheduled again before the first output is back: nothing new to preempt
    scheduler.finish(seqs["third"], SequenceStatus.FINISHED_ABORTED)
    scheduler.abandon_steps()
    out = scheduler.schedule()
    assert out.preempted_seq_ids == [seqs["second"].seq_id] and out.finished_seq_ids == [seqs["third"].seq_id]


class BrokenStructured:
    def bitmasks(self, grammars):
        raise RuntimeError("masks failed")


def test_a_step_that_fails_after_it_was_recorded_is_recorded_once():
    scheduler = Scheduler(SchedulerConfig(16, 64, 4096, True, "recompute", "priority"), BlockManager(64, 4, 0),
                          BrokenStructured())
    gone, bound = make_seq("gone", 3), make_seq("bound", 3, arrival=1, first_token=100)
    bound.grammar = FakeGrammar({7}, length=2)
    for seq in (gone, bound):
        scheduler.add(seq)
    scheduler.finish(gone, SequenceStatus.FINISHED_ABORTED)
    with pytest.raises(RuntimeError, match="masks failed"):
        scheduler.schedule()
    assert len(scheduler._records) == 1
    victims, _ = scheduler.abandon_steps()
    assert victims == {bound}
    scheduler.structured = FakeStructured()
    assert scheduler.schedule().finished_seq_ids == [gone.seq_id]


def test_the_output_reports_forked_samples_and_the_callback_gets_each_token():
    scheduler = make_scheduler(budget=100)
    pair, single = make_seq("pair", 4, best_of=2), make_seq("single", 4, arrival=1, first_token=100)
    for seq in (pair, single):
        scheduler.add(seq)
    out = scheduler.schedule()
    stop_at_8 = lambda seq, token: SequenceStatus.FINISHED_STOPPED if token.token_id == 8 else None  # noqa: E731
    sampled = {seq_id: tokens(8 if seq_id == single.seq_id else 7) for seq_id in runner_tokens(out)}
    changed = scheduler.update_from_output(ModelRunnerOutput(sampled), stop_at_8)
    assert set(changed) == {*pair.request.seqs, single} and len(pair.request.seqs) == 2
    assert single.status is SequenceStatus.FINISHED_STOPPED and pair.status is SequenceStatus.RUNNING


def test_a_decode_asks_for_no_prompt_logprobs():
    scheduler = make_scheduler(budget=100)
    request = Request("scored", None, list(range(10, 18)), SamplingParams(max_tokens=4, prompt_logprobs=1), 0.0)
    seq = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    scheduler.add(seq)
    assert scheduler.schedule().chunks[0].prompt_logprobs.targets == list(range(11, 18))
    scheduler.update_from_output(ModelRunnerOutput({seq.seq_id: tokens(7)}), lambda s, t: None)
    request.prompt_logprobs += [{} for _ in range(7)]
    assert scheduler.schedule().chunks[0].prompt_logprobs is None


def test_a_forked_request_counts_one_per_sample_once_forked():
    """max_num_seqs=4: the best_of=3 request, once forked, is 3 sequences; a request of one more
    fits beside them when the other has finished."""
    scheduler = make_scheduler(max_num_seqs=4, budget=100)
    wide, one = make_seq("wide", 4, best_of=3), make_seq("one", 4, arrival=1, first_token=100)
    two = make_seq("two", 4, arrival=2, first_token=200)
    for seq in (wide, one, two):
        scheduler.add(seq)
    run_step(scheduler)
    assert two.status is SequenceStatus.WAITING
    scheduler.finish(one, SequenceStatus.FINISHED_STOPPED)
    run_step(scheduler)
    assert two.status is SequenceStatus.RUNNING and len(scheduler.running) == 4


def test_the_last_decode_verifies_as_many_proposals_as_the_budget_leaves():
    """budget 8, two decodes with three proposals each: both verify all three (4 + 4 tokens)."""
    scheduler, a, b = two_decodes_with_three_proposals(budget=8)
    assert scheduled(scheduler.schedule()) == [(a.seq_id, 4), (b.seq_id, 4)]


def test_a_spent_budget_looks_at_no_waiting_prompt():
    """The budget spent by a decode: a prompt too long for the pool waits for a step with budget
    to be ended."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=1)
    a = make_seq("a", 1, max_tokens=50)
    scheduler.add(a)
    run_step(scheduler)
    too_long = make_seq("long", 17, arrival=1, first_token=100)
    scheduler.add(too_long)
    run_step(scheduler)
    assert too_long.status is SequenceStatus.WAITING
    scheduler.finish(a, SequenceStatus.FINISHED_STOPPED)
    run_step(scheduler)
    assert too_long.status is SequenceStatus.FINISHED_LENGTH


def fused_cycles_scheduler(max_num_seqs: int = 16) -> Scheduler:
    """Greedy draft-model speculation run as fused cycles (2 per step, k = 2)."""
    from pagedllm.config.speculative import SpeculativeConfig
    from pagedllm.step.planner import StepPlanner

    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="draft")
    planner = StepPlanner(max_model_len=4096, speculation=spec, fused_spec_cycles=True, num_scheduler_steps=2)
    return Scheduler(SchedulerConfig(max_num_seqs, 64, 4096, True, "recompute", "priority"), BlockManager(64, 4, 0),
                     planner=planner)


def test_fused_speculation_cycles_replace_verification_only_when_nothing_is_queued():
    """With nothing waiting the decode runs as 2 fused cycles of k + 1 positions (its pending
    proposals dropped: the cycles propose afresh); with a request waiting (no room for it) it
    verifies its proposals in a plain step instead."""
    for queued in (False, True):
        scheduler = fused_cycles_scheduler(max_num_seqs=1)
        a = greedy_seq("a", 4, max_tokens=50)
        scheduler.add(a)
        scheduler.schedule()
        scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7)}, spec_token_ids={a.seq_id: [1, 2]}),
                                     lambda s, t: None)
        if queued:
            scheduler.add(greedy_seq("b", 4, arrival=1, first_token=100))
        out = scheduler.schedule()
        chunk = out.chunks[0]
        if queued:
            assert (chunk.num_tokens, chunk.token_budget, chunk.max_proposals) == (3, 1, 2)
        else:
            assert (chunk.num_tokens, chunk.token_budget, chunk.max_proposals) == (1, 6, 2)


def test_proposals_pause_while_the_batch_is_large():
    scheduler = spec_scheduler(disable_by_batch_size=2)
    a, b = make_seq("a", 3), make_seq("b", 3, arrival=1, first_token=100)
    scheduler.add(a)
    assert scheduler.schedule().chunks[0].max_proposals == 3
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(7)}), lambda s, t: None)
    scheduler.add(b)
    assert [c.max_proposals for c in scheduler.schedule().chunks] == [0, 0]


def test_a_step_that_forks_samples_runs_no_burst():
    """A greedy best_of=2 request whose last prompt token completes in a step of its own forks
    there: that step is a single step, not a burst (the fork samples from its parent's row)."""
    from pagedllm.step.planner import StepPlanner

    scheduler = Scheduler(SchedulerConfig(16, 4, 4096, True, "recompute", "priority"), BlockManager(64, 4, 0),
                          planner=StepPlanner(max_model_len=4096, num_scheduler_steps=4))
    request = Request("pair", None, list(range(10, 15)), SamplingParams(max_tokens=16, temperature=0, best_of=2), 0.0)
    parent = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(parent)
    scheduler.add(parent)
    run_step(scheduler)  # 4 of 5 prompt tokens
    out = scheduler.schedule()
    assert len(out.new_seqs) == 1 and [(c.num_tokens, c.token_budget) for c in out.chunks] == [(1, 1)]


def test_a_finished_sequence_leaves_its_blocks_stamped_with_its_last_step():
    """LRU eviction of the prefix cache: a freed block carries the step its sequence last read it."""
    scheduler = make_scheduler()
    a = make_seq("a", 8)
    scheduler.add(a)
    for _ in range(3):
        run_step(scheduler)
    table = list(scheduler.block_manager.block_table(a.seq_id))
    scheduler.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert [scheduler.block_manager.last_access[block] for block in table] == [3] * len(table)


def test_a_deferred_step_qualifies_only_without_forks_or_host_reads():
    """Async scheduling advances a step ahead of its output only when nothing of the next step
    needs its tokens on the host: not a step that forks samples, nor one with prompt logprobs."""
    forking = planned_scheduler(async_scheduling=True)
    forking.add(make_seq("pair", 4, best_of=2))
    forking.schedule()
    assert not forking.defer_last()
    scoring = planned_scheduler(async_scheduling=True)
    request = Request("scored", None, list(range(10, 14)), SamplingParams(max_tokens=4, prompt_logprobs=1), 0.0)
    seq = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    scoring.add(seq)
    scoring.schedule()
    assert not scoring.defer_last() and seq.num_pending == 0


def test_a_deferred_burst_advances_by_every_token_but_the_last():
    scheduler = planned_scheduler(async_scheduling=True, num_scheduler_steps=4)
    a = greedy_seq("a", 3)
    scheduler.add(a)
    run_step(scheduler)
    assert scheduler.schedule().chunks[0].token_budget == 4
    assert scheduler.defer_last()
    assert (a.num_computed_tokens, a.num_pending) == (3 + 1 + 3, 4) and a.token_ids[-4:] == [PENDING_TOKEN] * 4
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(1, 2, 3, 4)}), lambda s, t: None)
    assert a.token_ids[3:] == [7, 1, 2, 3, 4] and a.num_computed_tokens == 7


def test_a_step_scheduled_ahead_skips_a_sequence_whose_last_token_is_on_the_device():
    """max_tokens=2: the step scheduled ahead of the first token's output still gives the second;
    the next one ahead gives nothing (its last token is out)."""
    scheduler = planned_scheduler(async_scheduling=True)
    a = make_seq("a", 5, max_tokens=2)
    scheduler.add(a)
    scheduler.schedule()
    assert scheduler.defer_last()
    assert scheduled(scheduler.schedule()) == [(a.seq_id, 1)]
    scheduler.update_from_output(ModelRunnerOutput({a.seq_id: tokens(42)}), lambda s, t: None)
    assert scheduler.defer_last()
    assert scheduled(scheduler.schedule()) == []


def burst_scheduler(mode: str = "recompute", num_blocks: int = 64, max_num_seqs: int = 16, watermark: float = 0.0) -> Scheduler:
    from pagedllm.step.planner import StepPlanner

    config = SchedulerConfig(max_num_seqs, 64, 4096, True, mode, "priority", watermark=watermark)
    return Scheduler(config, BlockManager(num_blocks, 4, 64 if mode == "swap" else 0),
                     planner=StepPlanner(max_model_len=4096, num_scheduler_steps=4))


def test_no_burst_while_a_request_waits_or_a_sequence_is_swapped_or_comes_back():
    """Bursts run only when nothing is queued: not with a request waiting for room, not with a
    sequence swapped out (its pool short), not in the step that swaps one in."""
    waiting = burst_scheduler(max_num_seqs=1)
    a = greedy_seq("a", 3)
    waiting.add(a)
    run_step(waiting)
    waiting.add(greedy_seq("b", 3, arrival=1, first_token=100))
    assert [c.token_budget for c in run_step(waiting).chunks] == [1]
    swapped = burst_scheduler(mode="swap", num_blocks=8, watermark=0.25)  # 2 blocks kept free
    a, s = greedy_seq("a", 12), greedy_seq("s", 12, arrival=1, first_token=100)
    for seq in (a, s):
        swapped.add(seq)
    run_step(swapped)  # 3 + 3 blocks
    swap_out(swapped, s)  # coming back needs 3 + 1 + 2 blocks: 5 are free
    out = run_step(swapped)
    assert s.status is SequenceStatus.SWAPPED and [(c.seq_id, c.token_budget) for c in out.chunks] == [(a.seq_id, 1)]
    back = burst_scheduler(mode="swap")
    a, s = greedy_seq("a", 3), greedy_seq("s", 3, arrival=1, first_token=100)
    for seq in (a, s):
        back.add(seq)
    run_step(back)
    swap_out(back, s)
    out = run_step(back)
    assert out.blocks_to_swap_in and [c.token_budget for c in out.chunks] == [1, 1]


def test_a_burst_that_falls_back_to_one_token_keeps_the_proposals_allowed():
    """A 2-block pool cannot reserve a 4-token burst: the step falls back to one token, and the
    decode may still propose for the next step (n-gram speculation, k = 3)."""
    scheduler = spec_scheduler(num_blocks=2, num_scheduler_steps=4)
    a = greedy_seq("a", 6)
    scheduler.add(a)
    run_step(scheduler)
    chunk = scheduler.schedule().chunks[0]
    assert (chunk.num_tokens, chunk.token_budget, chunk.max_proposals) == (1, 1, 3)


def test_a_burst_publishes_the_blocks_its_tokens_filled():
    """The burst's tokens fill a block before they are appended: the block is published with
    them, so a prompt repeating the sequence hits it."""
    scheduler = planned_scheduler(num_scheduler_steps=4)
    b = greedy_seq("b", 5, first_token=100)
    scheduler.add(b)
    run_step(scheduler)
    scheduler.schedule()
    scheduler.update_from_output(ModelRunnerOutput({b.seq_id: tokens(5, 6, 7, 8)}), lambda s, t: None)
    assert b.num_computed_tokens == 9
    request = Request("again", None, b.token_ids[:9], SamplingParams(max_tokens=4), 1.0)
    again = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(again)
    scheduler.add(again)
    scheduler.schedule()
    assert request.num_cached_tokens == 8
