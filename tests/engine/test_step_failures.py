"""A step that raises ends the requests it was computing — finish reason "error", the cause
logged — and nothing else: the engine, its other requests and its KV pool go on (LLMEngine.step).
Only MAX_FAILED_STEPS failures in a row, where the engine itself is broken, leave `step`.

The failures are injected where real ones come from: the runner (a kernel, staging), taking the
output back (detokenizing, stop rules), and scheduling (grammar masks)."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLMEngine, SamplingParams
from pagedllm.engine.llm_engine import MAX_FAILED_STEPS

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8], "poison": [9, 10, 11], "b": list(range(20, 50))}


def run(engine: LLMEngine) -> dict[str, object]:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def clean_tokens(model_dir, **engine_args) -> dict[str, list[int]]:
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), **engine_args)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, PARAMS)
    return {rid: out.outputs[0].token_ids for rid, out in run(engine).items()}


def poison_runner(engine: LLMEngine, failures: list[int] | None = None) -> set[int]:
    """The runner raises on every step that computes the request "poison"; returns the ids of
    every sequence the failed steps computed."""
    launch = engine.runner.launch
    failed_seqs: set[int] = set()

    def failing_launch(sched):
        poisoned = {seq.seq_id for seq in engine.requests["poison"].seqs} if "poison" in engine.requests else set()
        if any(chunk.seq_id in poisoned for chunk in sched.chunks):
            if failures is not None:
                failures.append(len(sched.chunks))
            failed_seqs.update(chunk.seq_id for chunk in sched.chunks)
            raise RuntimeError("injected kernel failure")
        return launch(sched)

    engine.runner.launch = failing_launch
    return failed_seqs


def assert_only_poison_failed(finals, clean, caplog) -> None:
    poison = finals["poison"]
    assert poison.status == "failed"
    assert all(c.finish_reason == "error" and "injected" in c.stop_reason for c in poison.outputs)
    for request_id in ("a", "b"):
        assert finals[request_id].outputs[0].finish_reason == "length"
        assert finals[request_id].outputs[0].token_ids == clean[request_id]
    assert any("engine step failed" in r.getMessage() and "poison" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failing_step_ends_its_request_and_the_others_finish(model_dir, caplog, mode):
    args = dict(max_num_seqs=1)  # one request a step: the poisoned step computes only "poison"
    if mode == "async":
        args.update(async_scheduling=True, decode_backend="torch")
    clean = clean_tokens(model_dir, **args)
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), **args)
    failed_seqs = poison_runner(engine)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, PARAMS)
    with caplog.at_level(logging.ERROR, logger="pagedllm.engine"):
        finals = run(engine)
    assert_only_poison_failed(finals, clean, caplog)
    engine.add_request("after", PROMPTS["a"], PARAMS)  # the engine serves on
    assert run(engine)["after"].outputs[0].token_ids == clean["a"]
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert failed_seqs and not failed_seqs & set(engine.runner.states)
    assert len(engine.runner.states) <= 1  # only "after": a finished sequence is dropped with the next step


def test_requests_sharing_the_failed_step_fail_with_it_and_leave_nothing_behind(model_dir):
    """Batched together, "poison" takes the requests of its step down (their KV is in doubt), and
    no block, runner state or queued sequence of theirs is left."""
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), enable_prefix_caching=False)
    failures: list[int] = []
    failed_seqs = poison_runner(engine, failures)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2))
    finals = run(engine)
    assert failures == [3]  # one failed step, holding all three requests
    assert {rid: o.status for rid, o in finals.items()} == {"a": "failed", "poison": "failed", "b": "failed"}
    assert all(len(o.outputs) == 2 for o in finals.values())
    assert not engine.scheduler.live and engine.request_states() == []
    engine.add_request("after", PROMPTS["a"], PARAMS)
    assert run(engine)["after"].status == "completed"
    assert not failed_seqs & set(engine.runner.states)


def test_a_failure_taking_the_output_back_ends_that_request(model_dir):
    clean = clean_tokens(model_dir, max_num_seqs=1)
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), max_num_seqs=1)
    process_token = engine.output_processor.process_token

    def failing_process_token(seq, token):
        if seq.request.request_id == "poison":
            raise RuntimeError("injected detokenizer failure")
        return process_token(seq, token)

    engine.output_processor.process_token = failing_process_token
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, PARAMS)
    finals = run(engine)
    assert finals["poison"].status == "failed" and "injected" in finals["poison"].outputs[0].stop_reason
    assert {rid: finals[rid].outputs[0].token_ids for rid in ("a", "b")} == {rid: clean[rid] for rid in ("a", "b")}


def test_a_failure_while_scheduling_ends_the_requests_it_scheduled(model_dir):
    """A grammar mask that cannot be computed fails in schedule(): the step never ran."""
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), max_num_seqs=1)
    engine.add_request("a", PROMPTS["a"], PARAMS)

    def failing_masks(out, sampled):
        if any(seq.request.request_id == "a" for seq in sampled):
            raise RuntimeError("injected grammar failure")

    engine.scheduler._attach_masks = failing_masks
    finals = run(engine)
    assert finals["a"].status == "failed" and "injected grammar failure" in finals["a"].outputs[0].stop_reason


def test_freed_blocks_a_failed_step_was_to_zero_are_zeroed_by_the_next(model_dir):
    """Secure mode: the blocks a finished request freed are zeroed by the step after — and when
    that step fails before it could zero them, by the one after that."""
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), secure_kv_blocks=True, enable_prefix_caching=False,
                                        max_num_seqs=1)
    engine.add_request("a", PROMPTS["b"], PARAMS)
    run(engine)
    used = list(engine.block_manager._to_zero)
    assert used and any(bool(engine.runner.kv_cache.k[:, block].any()) for block in used)
    poison_runner(engine)
    written: set[int] = set()  # the blocks the steps after the failure write
    schedule = engine.scheduler.schedule

    def spying_schedule():
        out = schedule()
        written.update(block for table in engine.block_manager.tables.values() for block in table)
        return out

    engine.scheduler.schedule = spying_schedule
    engine.add_request("poison", PROMPTS["poison"], PARAMS)
    engine.add_request("c", [3], SamplingParams(max_tokens=1))
    finals = run(engine)
    assert finals["poison"].status == "failed" and finals["c"].status == "completed"
    unwritten = [block for block in used if block not in written]
    assert unwritten and all(not bool(engine.runner.kv_cache.k[:, block].any()) for block in unwritten)


def test_steps_that_keep_failing_are_the_engine_failing(model_dir):
    """MAX_FAILED_STEPS failed steps in a row, whoever was in them: the exception leaves step()
    and the engine's owner fails what is left (the server reports the engine dead)."""
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), max_num_seqs=1)

    def broken(sched):
        raise RuntimeError("injected broken device")

    engine.runner.launch = broken
    for index in range(MAX_FAILED_STEPS):
        engine.add_request(str(index), [5 + index], PARAMS)
    with pytest.raises(RuntimeError, match="broken device"):
        run(engine)
    failed = engine.fail_unfinished("dead")
    assert len(failed) == 1 and torch.tensor(engine.get_stats()["num_free_blocks"]) == engine.get_stats()["num_total_blocks"]
