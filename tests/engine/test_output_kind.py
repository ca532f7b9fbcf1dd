"""`SamplingParams.output_kind` (vLLM's RequestOutputKind): CUMULATIVE reports a running request's
whole output at every step; FINAL_ONLY only its last one, so an offline batch (`LLM.generate`
asks for it) builds no snapshot of unfinished requests."""
from __future__ import annotations

import pytest

from pagedllm import LLM, RequestOutputKind, SamplingParams
from parity import PROMPTS


def steps_of(llm: LLM, params: SamplingParams, abort_after: int | None = None) -> list[list]:
    """Each step's outputs of two requests: (request id, finished, token count, finish reason)."""
    engine = llm.llm_engine
    for index in range(2):
        engine.add_request(f"{params.output_kind.name}-{index}", PROMPTS[index], params)
    seen = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        seen.append([(o.request_id[-1], o.finished, len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs])
        if abort_after is not None and len(seen) == abort_after:
            engine.abort_request(f"{params.output_kind.name}-1")
    return seen


def test_final_only_reports_each_request_once_with_the_cumulative_final_output(model_dir):
    llm = LLM(str(model_dir("llama")))
    cumulative = steps_of(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    final = steps_of(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                         output_kind=RequestOutputKind.FINAL_ONLY))
    assert sum(len(step) for step in cumulative) > 2 * 2  # every step reported the running requests
    reported = [entry for step in final for entry in step]
    assert sorted(reported) == sorted(entry for step in cumulative for entry in step if entry[1])
    assert all(finished for _, finished, _, _ in reported) and len(reported) == 2


def test_an_aborted_final_only_request_is_reported_once(model_dir):
    llm = LLM(str(model_dir("llama")))
    final = steps_of(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                         output_kind=RequestOutputKind.FINAL_ONLY), abort_after=3)
    reported = {request: reason for step in final for request, _, _, reason in step}
    assert reported == {"0": "length", "1": "abort"} and sum(len(step) for step in final) == 2


def test_generate_asks_for_final_outputs_without_changing_the_callers_params(model_dir, monkeypatch):
    llm = LLM(str(model_dir("llama")))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kinds = []
    add = llm.llm_engine.add_request
    monkeypatch.setattr(llm.llm_engine, "add_request", lambda rid, prompt, sp, **kw: (kinds.append(sp.output_kind),
                                                                                      add(rid, prompt, sp, **kw))[1])
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert kinds == [RequestOutputKind.FINAL_ONLY] * 3 and params.output_kind is RequestOutputKind.CUMULATIVE
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5, 5] and all(o.finished for o in outputs)


def test_delta_outputs_are_refused_by_name():
    with pytest.raises(ValueError, match="DELTA"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
