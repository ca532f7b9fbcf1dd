"""Async scheduling (engine/scheduler.py): the next step is scheduled and launched before the
last one's output is back, its inputs' newest tokens filled in on the device from the last
step's samples. On the CPU the device runs each step as it is launched, so what is checked here
is everything but the overlap: the same outputs as the synchronous engine (tokens, logprobs,
finish reasons, seeded samples) in the engine's modes, stop rules and aborts while a step is
in flight, no block leaked, and steps actually deferred (a silent fallback to synchronous
steps would fail). The overlap itself is measured on a GPU (`bench offline --device cuda
--engine-arg async_scheduling=true`) and checked there under `pytest -m cuda`."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.layers import kernels, triton_attention
from pagedllm.step.planner import StepPlanner
from pagedllm.step.scheduler_output import PENDING_TOKEN
from pagedllm.worker.cuda_graphs import DecodeGraphs
from parity import MODES, PROMPTS, assert_outputs_match

needs_cc = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler: no C attention kernels")
needs_triton = pytest.mark.skipif(triton_attention.triton is None, reason="Triton is not installed")

# Greedy with logprobs, seeded nucleus sampling, two seeded samples of one prompt, min_tokens.
MIXED = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=17, logprobs=1),
    SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=30, n=2),
    SamplingParams(temperature=0, max_tokens=25, min_tokens=3),
]


def run(llm: LLM, params) -> list:
    """Each completion's tokens, finish reason and top-N logprobs (token, rank, value)."""
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, [[(t, e.rank, e.logprob) for t, e in sorted(step.items())]
                                             for step in c.logprobs or []]) for c in o.outputs] for o in outputs]


def assert_same_outputs(ours: list, theirs: list) -> None:
    """The same tokens, finish reasons, ranks and top-N; logprob values within float rounding:
    an arrival may join a batch one step later when the sequences that finished in the step
    before are taken back only after it, and a batch of another size rounds differently."""
    assert [[(tokens, reason) for tokens, reason, _ in o] for o in ours] == \
           [[(tokens, reason) for tokens, reason, _ in o] for o in theirs]
    for mine, other in zip(ours, theirs):
        for (_, _, steps), (_, _, other_steps) in zip(mine, other):
            for step, other_step in zip(steps, other_steps, strict=True):
                assert [(t, rank) for t, rank, _ in step] == [(t, rank) for t, rank, _ in other_step]
                assert [v for *_, v in step] == pytest.approx([v for *_, v in other_step], abs=1e-4)


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and not engine.scheduler._records


@needs_cc
@pytest.mark.parametrize("mode", ["defaults", "chunked_prefill", "preempt_recompute", "preempt_swap"])
def test_async_scheduling_gives_the_synchronous_engines_outputs(mode, model_dir):
    params = [MIXED[i % len(MIXED)] for i in range(len(PROMPTS))]
    results = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir("llama")), decode_backend="torch", async_scheduling=overlap, **MODES[mode])
        results[overlap] = run(llm, params)
        assert_nothing_held(llm)
        deferred = llm.llm_engine.scheduler.num_deferred_steps
        assert (deferred > 20) if overlap else deferred == 0
        if mode.startswith("preempt"):
            assert llm.get_stats()["num_preemptions"] > 0
    assert_same_outputs(results[True], results[False])


@needs_cc
def test_penalties_read_the_token_still_on_the_device(model_dir):
    """A penalised decode's newest token is a placeholder when its next step is launched: the
    runner puts the sampled token among the penalised ones on the device (and into its copy of
    the history once the step's results are back), so penalised steps are deferred too and
    give the synchronous engine's tokens."""
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.5, frequency_penalty=2.0),
              SamplingParams(temperature=0.8, seed=11, max_tokens=16, frequency_penalty=1.2, min_tokens=4),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    results = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir("llama")), decode_backend="torch", async_scheduling=overlap)
        outputs = llm.generate(PROMPTS, [params[i % len(params)] for i in range(len(PROMPTS))], use_tqdm=False)
        results[overlap] = [o.outputs[0].token_ids for o in outputs]
        assert (llm.llm_engine.scheduler.num_deferred_steps > 10) == overlap
        assert_nothing_held(llm)
    assert results[True] == results[False]


@needs_cc
def test_a_grammar_and_a_penalised_request_joining_a_pipelined_batch(model_dir):
    """A constrained and a penalised request arrive while plain decodes' steps are in flight:
    they are admitted without a wait, the steps holding the grammar run synchronously (its mask
    needs the token), and every request ends as on the synchronous engine."""
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    late = {"g": SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,12}")),
            "pen": SamplingParams(temperature=0.7, seed=5, max_tokens=15, presence_penalty=0.4)}
    results = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir("llama")), decode_backend="torch", async_scheduling=overlap)
        engine, outputs = llm.llm_engine, []
        for index in range(3):
            engine.add_request(f"p{index}", PROMPTS[index], plain)
        for _ in range(4):
            outputs += engine.step()
        for offset, (request_id, params) in enumerate(late.items()):
            engine.add_request(request_id, PROMPTS[3 + offset], params)
        while engine.has_unfinished_requests():
            outputs += engine.step()
        results[overlap] = {o.request_id: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                            for o in outputs if o.finished}
        assert (engine.scheduler.num_deferred_steps > 0) == overlap
        assert_nothing_held(llm)
    assert results[True] == results[False] and results[True]["g"][2] == "stop"


@needs_cc
def test_stop_rules_end_a_sequence_whose_next_step_is_in_flight(model_dir):
    """A stop token found in a step's output ends the sequence although its next step was
    already launched: the token that step computed for it is dropped."""
    llm = LLM(str(model_dir("llama")), decode_backend="torch", async_scheduling=True)
    free = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].token_ids[5]
    cut = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)
    for before, after in zip(free, cut):
        tokens = before.outputs[0].token_ids
        end = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert after.outputs[0].token_ids == tokens[:end]
    assert cut[0].outputs[0].finish_reason == "stop"
    assert_nothing_held(llm)


@needs_cc
def test_an_abort_while_a_step_is_in_flight_reports_no_placeholder(model_dir):
    llm = LLM(str(model_dir("llama")), decode_backend="torch", async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{index}", prompt, params)
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None and any(seq.num_pending for seq in engine.scheduler.running)
    engine.abort_request("r1")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    assert finished["r1"].finish_reason == "abort" and PENDING_TOKEN not in finished["r1"].token_ids
    assert 0 < len(finished["r1"].token_ids) < 30
    assert all(len(finished[f"r{i}"].token_ids) == 30 for i in (0, 2, 3))
    assert_nothing_held(llm)


@needs_cc
def test_a_sequence_whose_last_tokens_are_in_flight_is_not_scheduled_again(model_dir, monkeypatch):
    """max_tokens counts the tokens still on the device: the step after the one that gives a
    sequence its last token does not compute it again (its prefill and four decodes, no sixth)."""
    llm = LLM(str(model_dir("llama")), decode_backend="torch", async_scheduling=True)
    runner = llm.llm_engine.runner
    scheduled: list[int] = []
    launch = runner.launch
    monkeypatch.setattr(runner, "launch", lambda sched: (scheduled.extend(c.seq_id for c in sched.chunks), launch(sched))[1])
    output = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 5
    assert len(scheduled) == 5 and llm.llm_engine.scheduler.num_deferred_steps >= 3
    assert_nothing_held(llm)


@needs_triton
def test_async_device_bursts_through_the_triton_kernels_and_padded_graph_batches(model_dir, reference):
    """The GPU's step: bursts of greedy passes on the device, batches padded as CUDA graphs take
    them, each burst's first input the last burst's final token, copied on the device; greedy
    tokens and logprobs against transformers' (the near-tie rule of the parity suites)."""
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0)
    llm = LLM(str(model_dir("llama")), attention_backend="triton", num_scheduler_steps=4, async_scheduling=True)
    runner = llm.llm_engine.runner
    runner.graphs = DecodeGraphs(runner.model, [1, 2, 4, 16], -(-runner.max_model_len // runner.block_size), runner.device)
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert_outputs_match(outputs, [(tokens[:9], logits[:9]) for tokens, logits in reference("llama")[:3]])
    assert runner.graphs.num_replays > 0 and llm.llm_engine.scheduler.num_deferred_steps > 0
    assert_nothing_held(llm)


def test_async_scheduling_is_off_where_nothing_overlaps(model_dir, caplog):
    """The fused C step returns only once it has run: asked for there, the planner turns async
    scheduling off and says why."""
    path = str(model_dir("llama"))
    config = EngineConfig(model=path, async_scheduling=True)
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine"):
        planner = StepPlanner.decide(config, ModelConfig.from_pretrained(path), 256)
    if planner.fused_decode:
        assert not planner.async_scheduling and "fused C decode step" in caplog.text
    torch_path = StepPlanner.decide(EngineConfig(model=path, async_scheduling=True, decode_backend="torch"),
                                    ModelConfig.from_pretrained(path), 256)
    assert torch_path.async_scheduling


@needs_cc
def test_a_request_arriving_while_a_step_is_in_flight_joins_without_a_wait(model_dir):
    """Admissions never preempt, so a new request does not take the step in flight back first:
    it is admitted while the running sequences' next step is scheduled ahead."""
    llm = LLM(str(model_dir("llama")), decode_backend="torch", async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    for _ in range(3):
        engine.step()
    deferred = engine.scheduler.num_deferred_steps
    engine.add_request("b", PROMPTS[1], params)
    outputs = engine.step()
    assert engine._in_flight is not None and engine.scheduler.num_deferred_steps == deferred + 1
    assert {seq.request.request_id for seq in engine.scheduler.running} == {"a", "b"} and not engine.scheduler.waiting
    assert [o.request_id for o in outputs] == ["a"]  # the step before, taken back while this one ran
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("steps", [1, 8])
def test_async_scheduling_on_cuda_gives_the_synchronous_engines_tokens(model_dir, steps):
    """On a GPU (`pytest -m cuda`): CUDA graphs, the Triton kernels, the results' copy left in
    flight; float32, so the same kernels give the same tokens either way."""
    params = [MIXED[i % len(MIXED)] for i in range(len(PROMPTS))]
    results = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir("llama")), device="cuda", dtype="float32", async_scheduling=overlap,
                  num_scheduler_steps=steps)
        assert llm.llm_engine.runner.graphs is not None
        results[overlap] = run(llm, params)
        assert (llm.llm_engine.scheduler.num_deferred_steps > 0) == overlap
        assert_nothing_held(llm)
    assert_same_outputs(results[True], results[False])
