"""Secure mode (secure_kv_blocks, design 001 Algorithm 2's SECURE_MODE) through the real runner: a
freed block's K/V is zero by the time another sequence's step runs over it, prefix-cached blocks
keep their content while they stay cached and are zeroed when evicted to be handed out; with the
mode off, a reused block still holds the previous sequence's K/V in the slots not yet written."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.step.scheduler_output import SchedulerOutput
from pagedllm.worker.model_runner import _stage_block_maps
from pagedllm.worker.staging import Staging


def run(engine: LLMEngine, name: str, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(name, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def spying_engine(model_dir, secure: bool) -> tuple[LLMEngine, list[SchedulerOutput]]:
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), block_size=4, num_kv_blocks=8, secure_kv_blocks=secure)
    steps: list[SchedulerOutput] = []
    execute = engine.runner.execute

    def spy(sched):
        steps.append(sched)
        return execute(sched)

    engine.runner.execute = spy
    return engine, steps


def block_is_zero(engine: LLMEngine, block: int, slots: slice = slice(None)) -> bool:
    cache = engine.runner.kv_cache
    return bool((cache.k[:, block, slots] == 0).all() and (cache.v[:, block, slots] == 0).all())


@pytest.mark.parametrize("secure", [True, False])
def test_freed_blocks_are_zeroed_before_reuse_and_cached_ones_only_when_evicted(model_dir, secure):
    engine, steps = spying_engine(model_dir, secure)
    bm = engine.block_manager
    run(engine, "a", list(range(11, 20)), 3)  # KV for 11 positions: 2 full blocks (cached) + 3 slots
    head, middle, tail = table_of_first_run(steps)
    assert bm.content[head] is not None and bm.content[middle] is not None and bm.content[tail] is None
    assert not block_is_zero(engine, tail, slice(0, 3))  # freed, zeroed at the next step at the earliest

    run(engine, "b", [50, 51], 1)  # takes the freed tail, writes its slots 0 and 1
    b_table = steps[-1].new_seqs[0].block_table
    assert b_table == [tail]
    assert (tail in steps[-1].blocks_to_zero) is secure
    assert block_is_zero(engine, tail, slice(2, 3)) is secure  # a's K/V in the slot b did not write
    assert not block_is_zero(engine, head) and not block_is_zero(engine, middle)  # cached: kept

    run(engine, "c", list(range(100, 130)), 1)  # 30 positions: all 8 blocks, evicting a's two
    c_table = steps[-1].new_seqs[0].block_table
    assert c_table[-2:] == [middle, head]  # evicted last, tail-first among blocks read in the same step
    assert ({head, middle} <= set(steps[-1].blocks_to_zero)) is secure
    assert block_is_zero(engine, head, slice(2, 4)) is secure  # c wrote slots 0 and 1 of its last block
    if not secure:
        assert all(not s.blocks_to_zero and not s.host_blocks_to_zero for s in steps)


def table_of_first_run(steps: list[SchedulerOutput]) -> list[int]:
    """The table of the one sequence these steps ran, as sent whole and grown by the updates."""
    table: list[int] = []
    for sched in steps:
        for seq in sched.new_seqs:
            table = list(seq.block_table)
        for update in sched.updates:
            table += list(update.new_block_ids)
    return table


def test_zeroing_comes_after_swap_outs_read_a_block_and_before_swap_ins_write_one(model_dir):
    """The order the step contract promises: swap-outs, zeroing, swap-ins, copies, host zeroing."""
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), block_size=4, num_kv_blocks=8, preemption_mode="swap",
                                        swap_space=1 << 20, secure_kv_blocks=True)
    cache, runner = engine.runner.kv_cache, engine.runner
    cache.k[:, 1] = 1.0
    cache.v[:, 1] = 1.0
    cache.k_cpu[:, 0] = 2.0
    cache.v_cpu[:, 0] = 2.0
    sched = SchedulerOutput(blocks_to_swap_out=[(1, 1)], blocks_to_swap_in=[(0, 1)], blocks_to_zero=[1],
                            host_blocks_to_zero=[0])
    staging = Staging()
    _stage_block_maps(sched, staging)
    runner._apply_block_maps(sched, staging.to(runner.device))
    assert (cache.k_cpu[:, 1] == 1).all() and (cache.v_cpu[:, 1] == 1).all()  # swapped out before zeroing
    assert (cache.k[:, 1] == 2).all() and (cache.v[:, 1] == 2).all()  # swapped in after zeroing
    assert (cache.k_cpu[:, 0] == 0).all() and (cache.v_cpu[:, 0] == 0).all()  # host zeroed after the swap-in
