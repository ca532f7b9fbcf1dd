"""Each request's state as the platform's data model names it — queued, prefilling, decoding,
preempted, completed, failed — with its timings and preemption count, on every RequestOutput and
in LLMEngine.request_states()."""
from __future__ import annotations

from pagedllm import LLMEngine, SamplingParams


def statuses_over_a_run(engine: LLMEngine) -> tuple[list[dict[str, str]], dict]:
    seen, finals = [], {}
    seen.append({row["id"]: row["status"] for row in engine.request_states()})
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        seen.append({row["id"]: row["status"] for row in engine.request_states()})
    return seen, finals


def test_a_request_goes_queued_prefilling_decoding_completed(model_dir):
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), max_num_batched_tokens=16, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(5, 45)), params)  # 40 tokens: three 16-token chunks
    engine.add_request("b", [5, 6, 7], params)  # waits for "a" (max_num_seqs=1)
    seen, finals = statuses_over_a_run(engine)
    a_states = [s["a"] for s in seen if "a" in s]
    assert a_states[0] == "queued" and "prefilling" in a_states and a_states[-1] == "decoding"
    assert a_states.index("prefilling") < a_states.index("decoding")
    assert [s["b"] for s in seen if "b" in s][:3] == ["queued"] * 3
    for output in finals.values():
        assert output.status == "completed" and output.num_preemptions == 0
        m = output.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert finals["a"].metrics.first_scheduled_time < finals["b"].metrics.first_scheduled_time


def test_preempted_requests_count_their_preemptions(model_dir):
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), num_kv_blocks=6, block_size=4, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), [5 + i, 6, 7, 8], params)
    seen, finals = statuses_over_a_run(engine)
    assert any("preempted" in s.values() for s in seen)
    assert sum(o.num_preemptions for o in finals.values()) == engine.get_stats()["num_preemptions"] > 0
    assert all(o.status == "completed" for o in finals.values())


def test_failed_requests_finish_with_error(model_dir):
    engine = LLMEngine.from_engine_args(str(model_dir("llama")))
    engine.add_request("a", [5, 6, 7], SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    engine.step()
    (output,) = engine.fail_unfinished("the engine failed: boom")
    assert output.finished and output.status == "failed" and len(output.outputs) == 2
    assert all(c.finish_reason == "error" and c.stop_reason == "the engine failed: boom" for c in output.outputs)
    assert not engine.has_unfinished_requests() and engine.request_states() == []
