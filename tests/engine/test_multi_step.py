"""Multi-step scheduling (num_scheduler_steps): several greedy decode steps per engine step, one
fused C call. Greedy outputs equal transformers' and the single-step engine's in every engine
mode, stop rules cut a burst where a single step would have stopped, blocks filled during a
burst are cached under the right tokens, and whatever is not a plain greedy decode (sampling,
logprobs, penalties, a waiting request) runs single steps."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.layers import kernels
from pagedllm.models.fused_decode import FusedDecoder
from parity import MAX_TOKENS, MODES, PROMPTS, assert_mode_happened, assert_outputs_match

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler: no fused decode step")

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
STEP_MODES = ("defaults", "prefix_caching", "chunked_prefill", "preempt_recompute", "preempt_swap", "block_size_1")
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture
def bursts(monkeypatch):
    """The step count of every multi-step call made during the test."""
    seen: list[int] = []
    original = FusedDecoder.decode_steps

    def counted(self, rows, num_steps, draws=None):
        seen.append(num_steps)
        return original(self, rows, num_steps, draws)

    monkeypatch.setattr(FusedDecoder, "decode_steps", counted)
    return seen


@pytest.mark.parametrize("mode", STEP_MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_multi_step_greedy_matches_transformers(arch, mode, model_dir, reference, bursts):
    llm = LLM(str(model_dir(arch)), num_scheduler_steps=8, **MODES[mode])
    runs = 2 if mode == "prefix_caching" else 1
    for _ in range(runs):
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_outputs_match(outputs, reference(arch))
        for completion in (output.outputs[0] for output in outputs):
            assert all(step[token].rank == 1 for step, token in zip(completion.logprobs, completion.token_ids))
    assert_mode_happened(llm.get_stats(), mode)
    assert max(bursts) == 8 and all(1 <= n <= 8 for n in bursts)  # (one: a step with a single position left)


def _single_and_multi(folder, prompts, params, **engine_args):
    outputs = []
    for steps in (1, 8):
        llm = LLM(str(folder), num_scheduler_steps=steps, **engine_args)
        outputs.append(llm.generate(prompts, params, use_tqdm=False))
    return outputs


def test_stop_rules_cut_a_burst_where_single_steps_stop(model_dir, bursts):
    folder = model_dir("llama")
    free_run = LLM(str(folder)).generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                         use_tqdm=False)
    tokens, text = free_run[0].outputs[0].token_ids, free_run[1].outputs[0].text
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[11]]),  # a token in mid-burst
        SamplingParams(temperature=0, max_tokens=30, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),  # not a multiple of the burst
    ]
    single, multi = _single_and_multi(folder, PROMPTS[:3], params)
    for a, b in zip(single, multi):
        assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason) == \
               (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason)
    assert [o.outputs[0].finish_reason for o in multi] == ["stop", "stop", "length"]
    assert len(multi[0].outputs[0].token_ids) < 30 and len(multi[2].outputs[0].token_ids) == 13
    assert bursts


def test_blocks_filled_in_a_burst_are_cached_under_their_tokens(model_dir, bursts):
    """A later prompt that extends an earlier prompt and its output hits the blocks the burst
    wrote, and continues exactly as an engine without the cache does."""
    folder, prompt = model_dir("qwen3"), PROMPTS[5]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(str(folder), num_scheduler_steps=8, block_size=4)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    hits_before = llm.get_stats()["prefix_cache_hits"]
    follow_up = prompt + first[:36]
    ours = llm.generate([follow_up], params, use_tqdm=False)[0].outputs[0].token_ids
    hits = llm.get_stats()["prefix_cache_hits"] - hits_before
    assert hits >= len(prompt) + 32  # blocks of output positions, written during bursts, were reused
    plain = LLM(str(folder), enable_prefix_caching=False).generate([follow_up], params, use_tqdm=False)
    assert ours == plain[0].outputs[0].token_ids


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_one_step_takes_its_argmax_in_the_fused_call_with_the_samplers_tokens_and_logprobs(arch, model_dir, bursts):
    """Without multi-step scheduling a step of plain greedy decodes is a burst of one: the fused
    call takes each row's argmax (several rows, shared among the threads) and the sampler is not
    run. Its tokens and logprobs are the sampler's greedy kernel's, bit for bit; asked for the
    chosen token's logprob entry (logprobs=0), the sampler's log-softmax agrees to float rounding."""
    folder = str(model_dir(arch))
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ranked = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    in_step = LLM(folder, num_scheduler_steps=1)  # (offline generate's own default: bursts of four)
    fused = [in_step.generate(PROMPTS, params, use_tqdm=False) for params in (plain, ranked)]
    assert bursts and set(bursts) == {1}
    bursts.clear()
    by_sampler = LLM(folder, num_scheduler_steps=1)
    engine = by_sampler.llm_engine
    engine.planner = engine.scheduler.planner = engine.runner.planner = replace(engine.planner, fused_argmax=False)
    sampled = [by_sampler.generate(PROMPTS, params, use_tqdm=False) for params in (plain, ranked)]
    assert not bursts
    for a, b in zip(fused[0], sampled[0]):
        assert (a.outputs[0].token_ids, a.outputs[0].cumulative_logprob) == (b.outputs[0].token_ids, b.outputs[0].cumulative_logprob)
    for a, b in zip(fused[1], sampled[1]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ours, theirs, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert ours[token].rank == theirs[token].rank == 1
            assert ours[token].logprob == pytest.approx(theirs[token].logprob, rel=1e-5, abs=1e-6)


def test_by_default_outputs_returned_whole_take_bursts_of_four_and_streamed_ones_single_steps(model_dir, bursts):
    """num_scheduler_steps unset: offline generate returns each output whole (FINAL_ONLY), so its
    plain greedy decodes run four steps a call, with the single-step engine's tokens; a request
    whose output is streamed (the engine API's default, and the server's) gets every token from its
    own step."""
    folder = str(model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    whole = LLM(folder).generate(PROMPTS, params, use_tqdm=False)
    assert max(bursts) == 4 and all(1 <= n <= 4 for n in bursts)
    bursts.clear()
    single = LLM(folder, num_scheduler_steps=1).generate(PROMPTS, params, use_tqdm=False)
    assert set(bursts) == {1}
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in single]
    bursts.clear()
    engine = LLM(folder).llm_engine
    engine.add_request("streamed", PROMPTS[0], params)
    grown = []
    while engine.has_unfinished_requests():
        grown += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert set(bursts) == {1} and grown == list(range(1, 21))


def test_requests_that_are_not_plain_greedy_take_single_steps(model_dir, bursts):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, presence_penalty=0.5),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, logprobs=0),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=12, ignore_eos=False),
    ]
    for param in params:
        bursts.clear()
        single, multi = _single_and_multi(model_dir("llama"), PROMPTS[:2], param)
        for a, b in zip(single, multi):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert not bursts, param


def test_plain_random_requests_are_drawn_in_the_call_with_the_samplers_tokens(model_dir, bursts, monkeypatch):
    """Sampling at a temperature, min_p, top-k and top-p with nothing else: the fused call draws
    the tokens itself, in single steps (bursts of one) and in bursts of 8, and they are the tokens
    the sampler draws (its path forced by taking the rule away) — seeded rows from their own
    generators, an unseeded one from the engine's, each row by its own filters, greedy rows beside
    them their argmax."""
    import pagedllm.step.planner as planner_module

    folder = str(model_dir("llama"))
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.3, min_p=0.05, seed=8, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.6, seed=9, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=3, top_p=0.95, min_p=0.05, seed=10, max_tokens=12, ignore_eos=True)]
    prompts = PROMPTS[:2] * 3
    drawn = {steps: LLM(folder, num_scheduler_steps=steps, seed=3).generate(prompts, params, use_tqdm=False) for steps in (1, 8)}
    assert 8 in bursts and 1 in bursts
    bursts.clear()
    monkeypatch.setattr(planner_module, "plain_random_decode", lambda seq: False)
    sampled = LLM(folder, seed=3).generate(prompts, params, use_tqdm=False)
    assert not bursts
    expected = [o.outputs[0].token_ids for o in sampled]
    for steps, outputs in drawn.items():
        assert [o.outputs[0].token_ids for o in outputs] == expected, steps
        assert [o.outputs[0].cumulative_logprob for o in outputs] == pytest.approx([o.outputs[0].cumulative_logprob for o in sampled], abs=1e-4)
    assert len({tuple(t) for t in expected[:3]}) == 3


def test_a_waiting_request_is_admitted_before_the_next_burst(model_dir, bursts):
    llm = LLM(str(model_dir("llama")), num_scheduler_steps=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.step()  # the prefill
    engine.step()  # a burst
    assert bursts == [8]
    engine.add_request("b", PROMPTS[1], params)
    scheduled = []
    original = engine.runner.execute
    engine.runner.execute = lambda sched: scheduled.append(sched) or original(sched)
    engine.step()
    assert {c.token_budget for c in scheduled[0].chunks} == {1} and {c.num_tokens > 1 for c in scheduled[0].chunks} == {True, False}
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    plain = LLM(str(model_dir("llama"))).generate(PROMPTS[:2], params, use_tqdm=False)
    assert [outputs[r].outputs[0].token_ids for r in "ab"] == [o.outputs[0].token_ids for o in plain]


def test_bad_or_unusable_step_counts(model_dir, caplog):
    folder = str(model_dir("llama"))
    with pytest.raises(ValueError, match="num_scheduler_steps must be a positive integer"):
        LLM(folder, num_scheduler_steps=0)
    with pytest.raises(ValueError, match="needs a draft model with fused_cycles"):
        LLM(folder, num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine"):
        llm = LLM(folder, num_scheduler_steps=4, attention_backend="sdpa")
    assert "needs the fused decode step" in caplog.text
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still runs, one step at a time
