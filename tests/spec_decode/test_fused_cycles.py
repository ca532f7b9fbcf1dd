"""Greedy draft-model speculation run as whole cycles in one C call (spec_decode/fused_cycles.py):
the tokens of greedy decoding without speculation, in every engine mode and with several cycles
per engine step; the draft's KV exact across the fused and the engine-driven paths (a draft
equal to the target has every proposal accepted); stop rules and length limits inside a burst;
proposals cut at the draft's confidence floor (draft_p_min); and the fused path taken exactly when every running sequence is a plain greedy decode."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.step.planner import StepKind
from parity import MAX_TOKENS, MODES, PROMPTS, assert_mode_happened
from test_spec_decode import ARCHS, GREEDY, SPEC_MODES, greedy_tokens, staggered


def fused_steps(llm: LLM, with_rows: bool = False) -> list:
    """From now on, each engine step that ran fused cycles: its cycles (and its sequences)."""
    steps: list = []
    runner = llm.llm_engine.runner
    original, planner = runner.execute, runner.planner

    def execute(sched):
        first = sched.chunks[0] if sched.chunks else None
        if first is not None and planner.step_kind(first.token_budget, first.max_proposals) is StepKind.SPEC_CYCLES:
            cycles = first.token_budget // (planner.num_speculative_tokens + 1)
            steps.append((cycles, len(sched.chunks)) if with_rows else cycles)
        return original(sched)

    runner.execute = execute
    return steps


def same_model_draft(folder: str, **extra) -> dict:
    return {"model": folder, "num_speculative_tokens": 3, **extra}


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("mode", SPEC_MODES)
def test_a_draft_equal_to_the_target_accepts_everything_in_fused_cycles(mode, steps, model_dir):
    """Every prompt at once, each stopping at its own length: the big batch runs the
    engine-driven path (more sequences than one fused call takes), the last four run fused
    cycles, through preemption (both kinds), chunked prefill and prefix-cache hits (a second
    pass). The draft's KV stays exact across both paths, so every proposal is accepted, and the
    tokens are those of decoding without speculation."""
    folder = str(model_dir("llama"))
    llm = LLM(folder, speculative_config=same_model_draft(folder), num_scheduler_steps=steps, **MODES[mode])
    plain = LLM(folder, **MODES[mode])
    fused = fused_steps(llm)
    lengths = [MAX_TOKENS - 2 * i for i in range(len(PROMPTS))]
    for _ in range(2 if mode == "prefix_caching" else 1):
        assert staggered(llm, lengths) == staggered(plain, lengths)
    assert steps in fused and set(fused) <= {1, steps}  # 1: no room in a small pool for more cycles
    stats = llm.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert_mode_happened(stats, mode)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_real_draft_in_fused_cycles_keeps_greedy_tokens(arch, model_dir, draft_dir):
    """A draft that is often wrong (the target cut to one layer): rejections at every position,
    one and several cycles per engine step, every architecture the fused decode step runs."""
    folder = str(model_dir(arch))
    plain = [greedy_tokens(LLM(folder), [p]) for p in PROMPTS[:4]]
    for steps in (1, 3):
        llm = LLM(folder, speculative_config={"model": str(draft_dir(arch)), "num_speculative_tokens": 3},
                  num_scheduler_steps=steps)
        fused = fused_steps(llm)
        assert [greedy_tokens(llm, [p]) for p in PROMPTS[:4]] == plain
        assert fused
        stats = llm.get_stats()
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        assert 0 < stats["spec_decode_draft_time_s"] and 0 < stats["spec_decode_target_time_s"]


def test_stop_rules_and_limits_inside_a_burst(model_dir):
    """Tokens past a stop token, max_tokens or max_model_len are produced inside a fused call
    and dropped, as multi-step scheduling drops them."""
    folder = str(model_dir("llama"))
    prompt = PROMPTS[4]
    plain = greedy_tokens(LLM(folder), [prompt])[0]
    llm = LLM(folder, speculative_config=same_model_draft(folder), num_scheduler_steps=4)
    fused = fused_steps(llm)
    stop_at = plain[9]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == plain[: plain.index(stop_at) + 1] and stopped.finish_reason == "stop"
    for n in (1, 2, 5, 7):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain[:n]
    short = LLM(folder, speculative_config=same_model_draft(folder), num_scheduler_steps=4, max_model_len=len(prompt) + 7)
    out = short.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain[:7] and out.finish_reason == "length"
    assert fused
    assert short.llm_engine.block_manager.num_free_blocks == short.llm_engine.block_manager.num_blocks


def test_the_fused_path_is_taken_only_for_plain_greedy_decodes(model_dir):
    """A sampled request in the batch sends every decode through the engine-driven path (it
    verifies by rejection sampling); once it finishes the greedy one goes on in fused cycles,
    first dropping the proposals the engine-driven step made. fused_cycles=false never fuses."""
    folder = str(model_dir("llama"))
    plain = greedy_tokens(LLM(folder), PROMPTS[:1])[0]
    llm = LLM(folder, speculative_config=same_model_draft(folder))
    fused = fused_steps(llm, with_rows=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:2], [GREEDY, sampled], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == plain
    assert fused and {rows for _, rows in fused} == {1}, "the fused path ran while a sampled request was decoding"
    assert llm.get_stats()["spec_decode_num_drafts"] > len(fused)  # the engine-driven steps verified too
    assert greedy_tokens(llm, PROMPTS[:2]) == greedy_tokens(LLM(folder), PROMPTS[:2])
    assert any(rows == 2 for _, rows in fused), "two greedy decodes did not share a fused call"

    engine_driven = LLM(folder, speculative_config=same_model_draft(folder, fused_cycles=False))
    never = fused_steps(engine_driven)
    assert greedy_tokens(engine_driven, PROMPTS[:1])[0] == plain
    assert not never and engine_driven.get_stats()["spec_decode_num_drafts"] > 0


def test_an_int8_draft_only_changes_the_proposals(model_dir, draft_dir):
    """quantization="int8" quantizes the draft's weights at load (its passes read a quarter of
    the bytes); the target verifies every token, so greedy tokens are unchanged."""
    folder = str(model_dir("llama"))
    plain = [greedy_tokens(LLM(folder), [p]) for p in PROMPTS[:3]]
    llm = LLM(folder, speculative_config={"model": str(draft_dir("llama")), "num_speculative_tokens": 3, "quantization": "int8"})
    fused = fused_steps(llm)
    assert [greedy_tokens(llm, [p]) for p in PROMPTS[:3]] == plain
    assert fused and llm.get_stats()["spec_decode_num_accepted_tokens"] > 0
    draft = llm.llm_engine.runner.speculator.draft.model
    assert {linear.small.panels.dtype for linear in draft.linears()} == {torch.int8}
    assert {linear.small.panels.dtype for linear in llm.llm_engine.runner.model.linears()} == {torch.float32}


@pytest.mark.parametrize("engine_args", [{"num_scheduler_steps": 1}, {"num_scheduler_steps": 4},
                                         {"speculative_config": {"fused_cycles": False}}], ids=["fused", "fused-4", "engine-driven"])
def test_draft_p_min_leaves_out_unsure_proposals_only(engine_args, model_dir):
    """draft_p_min: a greedy proposal the draft gives less than p_min ends the proposals. With the
    target as its own draft, p_min at the median probability of the target's greedy tokens makes
    about half the proposals, every one of them accepted (the draft's KV stays exact after an
    early stop: the fused path's frontier counts the proposals it was fed), and the tokens are
    those of decoding without speculation."""
    import math

    folder = str(model_dir("llama"))
    outputs = LLM(folder).generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False)
    plain = [o.outputs[0].token_ids for o in outputs]
    chosen = [math.exp(lp[t].logprob) for o in outputs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    p_min = sorted(chosen)[len(chosen) // 2]
    made = {}
    for threshold in (0.0, p_min):
        config = same_model_draft(folder, draft_p_min=threshold, **engine_args.get("speculative_config", {}))
        llm = LLM(folder, speculative_config=config, num_scheduler_steps=engine_args.get("num_scheduler_steps", 1))
        fused = fused_steps(llm)
        assert greedy_tokens(llm, PROMPTS[:4]) == plain
        assert bool(fused) == config.get("fused_cycles", True)
        stats = llm.get_stats()
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
        made[threshold] = stats["spec_decode_num_draft_tokens"]
    assert 0 < made[p_min] < made[0.0]


def test_bad_fused_cycles_quantization_and_p_min_values_are_refused(model_dir):
    folder = str(model_dir("llama"))
    with pytest.raises(ValueError, match="fused_cycles must be true or false"):
        LLM(folder, speculative_config=same_model_draft(folder, fused_cycles="yes"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(folder, speculative_config=same_model_draft(folder, quantization="int4"))
    with pytest.raises(ValueError, match="quantization applies to a draft model only"):
        LLM(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"})
    with pytest.raises(ValueError, match="needs a draft model with fused_cycles"):
        LLM(folder, speculative_config=same_model_draft(folder, fused_cycles=False), num_scheduler_steps=2)
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(ValueError, match=r"draft_p_min must be a number in \[0, 1\)"):
            LLM(folder, speculative_config=same_model_draft(folder, draft_p_min=bad))
    with pytest.raises(ValueError, match="draft_p_min applies to a draft model only"):
        LLM(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_p_min": 0.5})


def test_the_drafts_kv_below_its_frontier_is_the_targets(model_dir):
    """The invariant the cycles keep: the draft's KV is valid below the position it reports
    (the prompt it mirrored, its catch-ups, and the proposals it was fed that the target kept;
    not the last proposal, which it never fed). With the target as its own draft both pools
    must then hold the same K and V at every such position, checked mid-generation."""
    folder = str(model_dir("llama"))
    llm = LLM(folder, speculative_config=same_model_draft(folder), num_scheduler_steps=2, block_size=4)
    engine = llm.llm_engine
    fused = fused_steps(llm)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[5]}, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(3):  # the prompt, then two engine steps of two cycles
        engine.step()
    assert fused
    seq = engine.scheduler.running[0]
    frontier = min(seq.num_draft_computed, seq.num_computed_tokens)
    assert frontier > len(PROMPTS[5]) + 4
    table = engine.block_manager.block_table(seq.seq_id)
    blocks = torch.tensor([table[p // 4] for p in range(frontier)])
    offsets = torch.tensor([p % 4 for p in range(frontier)])
    target, draft = engine.runner.kv_cache, engine.runner.speculator.draft.kv_cache
    for layer in range(engine.model_config.num_layers):
        for ours, theirs in zip(draft.layer(layer), target.layer(layer)):
            torch.testing.assert_close(ours[blocks, offsets], theirs[blocks, offsets], rtol=1e-5, atol=1e-6)


def test_a_short_prompt_is_mirrored_into_the_draft_as_one_fused_step(model_dir, monkeypatch):
    """The draft mirrors a short prompt (what fits one fused step) as decode rows in one fused
    call, as the target computes it; with the target as draft every proposal is then accepted
    (its KV exact), and the tokens are those of decoding without speculation."""
    from pagedllm.models.fused_decode import FusedDecoder

    folder = str(model_dir("llama"))
    prompt = [3 + j for j in range(12)]
    plain = greedy_tokens(LLM(folder), [prompt])
    llm = LLM(folder, speculative_config=same_model_draft(folder))
    draft = llm.llm_engine.runner.speculator.draft.model.fused
    calls: list[tuple[bool, int]] = []
    original = FusedDecoder.__call__

    def counted(self, input_ids, *rest):
        calls.append((self is draft, input_ids.shape[0]))
        return original(self, input_ids, *rest)

    monkeypatch.setattr(FusedDecoder, "__call__", counted)
    assert greedy_tokens(llm, [prompt]) == plain
    assert calls[:2] == [(False, 12), (True, 12)]  # the target's prefill, then the draft's mirror
    stats = llm.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("fused_cycles, window", [(True, 8), (True, 24), (False, 8)],
                         ids=["fused", "fused-mirrored-in-steps", "engine-driven"])
def test_a_windowed_draft_mirrors_only_what_it_can_read(fused_cycles, window, model_dir, draft_dir, monkeypatch):
    """draft_attention_window W: every draft layer attends to its last W positions, so a prompt
    is mirrored only as far back as the layers' windows reach from its end (in one fused step, or
    at W = 24 in several: more rows than one takes). Greedy tokens are unchanged (only proposals
    can be); the mirror computes `reach` positions; and the draft's KV of the positions it
    computed equals that of a mirror of the whole prompt (through the modules)."""
    from pagedllm.spec_decode.draft_model import DraftModel

    folder = str(model_dir("llama"))
    prompt = [3 + (5 * j) % 200 for j in range(70)]
    plain = greedy_tokens(LLM(folder), [prompt])
    config = {"model": str(draft_dir("llama")), "num_speculative_tokens": 3, "draft_attention_window": window,
              "fused_cycles": fused_cycles}
    pools = []
    for skip in (True, False):
        if not skip:  # the same draft mirroring the whole prompt
            monkeypatch.setattr(DraftModel, "reach", property(lambda self: None))
        llm = LLM(folder, speculative_config=config)
        draft = llm.llm_engine.runner.speculator.draft
        rows = []
        original = draft.propose

        def propose(requests, *rest, original=original):
            rows.append(sum(len(r.tokens) for r in requests))
            return original(requests, *rest)

        draft.propose = propose
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # the prefill (and its mirror) only
        llm.generate([prompt], params, use_tqdm=False)
        layers = [tuple(t.clone() for t in draft.kv_cache.layer(i)) for i in range(len(draft.model_config.sliding_windows))]
        pools.append((rows[0], layers))  # the sequence's blocks are free again, their KV still in the pool
        assert greedy_tokens(llm, [prompt]) == plain
        assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    (computed, windowed), (whole, full) = pools
    assert (computed, whole) == (window * len(windowed), len(prompt))
    bs = windowed[0][0].shape[1]
    for layer, (mine, theirs) in enumerate(zip(windowed, full)):
        # layer l's KV at p depends on positions back to p - W l: exact from the mirror's start + W l
        for p in range(len(prompt) - computed + window * layer, len(prompt)):  # block ids count from 0 in a fresh pool
            for a, b in zip(mine, theirs):
                assert b[p // bs, p % bs].abs().sum() > 0 and torch.allclose(a[p // bs, p % bs], b[p // bs, p % bs], atol=1e-5)


def test_bad_draft_attention_windows_are_refused(model_dir):
    folder = str(model_dir("llama"))
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="draft_attention_window must be a positive integer"):
            LLM(folder, speculative_config=same_model_draft(folder, draft_attention_window=bad))
    with pytest.raises(ValueError, match="draft_attention_window applies to a draft model only"):
        LLM(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_attention_window": 8})
