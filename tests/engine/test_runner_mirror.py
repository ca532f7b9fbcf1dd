"""The runner's copy of each sequence, built only from what the steps sent (new sequences once,
then new tokens, new blocks, copy-on-write replacements, whole tables after a swap-in), equals
the scheduler's own state at every step: through chunked prefill, forks of n > 1 samples that
copy their shared tail on write, and preemption by swap and by recompute."""
from __future__ import annotations

import pytest

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.runner_mirror import RunnerMirror
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import Request, Sequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.worker.sequence_state import SequenceStates


def add_request(scheduler: Scheduler, name: str, prompt_len: int, params: SamplingParams, first_token: int) -> None:
    request = Request(name, None, list(range(first_token, first_token + prompt_len)), params, float(first_token))
    seq = Sequence(request, 0, list(request.prompt_token_ids))
    request.seqs.append(seq)
    scheduler.add(seq)


def run_and_compare(scheduler: Scheduler, steps: int) -> dict[str, int]:
    """Steps with a runner that answers token 7 + step; after each, the replica of every
    scheduled sequence must equal the scheduler's. Counts what the steps sent."""
    replica, seen = SequenceStates(), {"new": 0, "replaced": 0, "whole": 0, "preempted": 0}
    for step in range(steps):
        out = scheduler.schedule()
        replica.apply(out)
        seen["new"] += len(out.new_seqs)
        seen["replaced"] += sum(bool(u.replaced_blocks) for u in out.updates)
        seen["whole"] += sum(u.block_table is not None for u in out.updates)
        seen["preempted"] += len(out.preempted_seq_ids)
        for chunk in out.chunks:
            seq, state = scheduler.live[chunk.seq_id], replica[chunk.seq_id]
            assert state.token_ids == seq.token_ids and state.num_computed_tokens == seq.num_computed_tokens
            assert state.block_table == scheduler.block_manager.block_table(seq.seq_id)
        sampling = [c.seq_id for c in out.chunks if c.token_budget] + [s.seq_id for s in out.new_seqs if s.forked_from is not None]
        sampled = {seq_id: [SampledToken(7 + step % 50, 0.0)] for seq_id in sampling}
        scheduler.update_from_output(ModelRunnerOutput(sampled), lambda seq, token: None)
    return seen


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_runners_copy_equals_the_schedulers_state(mode):
    bm = BlockManager(12, 4, 32 if mode == "swap" else 0)
    scheduler = Scheduler(SchedulerConfig(8, 12, 4096, True, mode, "fcfs"), bm)
    add_request(scheduler, "forks", 10, SamplingParams(n=3, temperature=1.0, max_tokens=40, ignore_eos=True), 100)
    add_request(scheduler, "long", 14, SamplingParams(max_tokens=40, ignore_eos=True), 200)
    seen = run_and_compare(scheduler, 40)
    assert seen["new"] >= 4 and seen["replaced"] > 0 and (seen["whole"] if mode == "swap" else seen["preempted"]) > 0, seen


def test_a_table_change_is_sent_as_what_changed():
    mirror, request = RunnerMirror(), Request("r", None, [1, 2, 3], SamplingParams(), 0.0)
    seq = Sequence(request, 0, [1, 2, 3])
    assert mirror.describe(seq, [4, 5]).block_table == [4, 5]  # new: whole
    seq.token_ids.append(9)
    update = mirror.describe(seq, [4, 6, 7])
    assert (update.new_token_ids, update.replaced_blocks, update.new_block_ids, update.block_table) == ([9], [(1, 6)], [7], None)
    update = mirror.describe(seq, [8, 9, 10])  # a swap-in: fresh blocks
    assert (list(update.new_token_ids), list(update.new_block_ids), update.block_table) == ([], [], [8, 9, 10])
    mirror.forget(seq.seq_id)
    assert mirror.describe(seq, [8, 9, 10]).token_ids == [1, 2, 3, 9]  # sent whole again
