"""Beam search against transformers' `num_beams` generate, and its KV sharing.

Beam search is a layer over the engine (engine/beam_search.py): each round, every beam is a
one-token request, and the beams share KV through the prefix cache. In the small-pool modes a
round's requests do not all fit at once, so some wait for the others' blocks.

Two tiny models: the suite's Llama, and a Qwen3 whose EOS row of the LM head points along the
mean final hidden state, so EOS is among the top few tokens almost everywhere — hypotheses end
on EOS, the early-stopping heuristic ends searches before max_tokens, and both must match.
"""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, BeamSearchParams
from pagedllm.engine.beam_search import BeamSearcher
from tiny_models import build_model, load_reference

PROMPTS = [[random.Random(n).randrange(3, 380) for _ in range(n)] for n in (3, 9, 17, 30, 5)]
SCORE_TOLERANCE = 1e-4

MODES = {
    "defaults": dict(block_size=4),
    "prefix_caching": dict(block_size=4, enable_prefix_caching=True),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=8),
    "preempt_recompute": dict(block_size=4, num_kv_blocks=10, preemption_mode="recompute"),
    "preempt_swap": dict(block_size=4, num_kv_blocks=10, preemption_mode="swap", swap_space=1 << 20),
}

# (beam width, max tokens, length penalty[, early_stopping]); the engine modes run the first only.
SEARCHES = [(4, 9, 0.0), (3, 10, 1.0), (2, 12, 2.0)]
# transformers' other two stopping rules: at once when `width` hypotheses exist, and the exact bound
EARLY_STOPPING = [(4, 16, 2.0, True), (4, 9, 0.0, True), (3, 10, 1.0, "never"), (2, 12, 2.0, "never"), (3, 8, -1.0, "never")]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    folder = build_model(tmp_path_factory.mktemp("eos-heavy"), "qwen3", seed=3)
    model = load_reference(folder)
    ids = torch.tensor([PROMPTS[3] + PROMPTS[1]])
    with torch.no_grad():
        direction = model.model(ids).last_hidden_state[0].mean(0)
        model.lm_head.weight[1] = direction / direction.norm()
    model.save_pretrained(folder)
    return folder


def transformers_beams(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
                       early_stopping: bool | str = False):
    out = model.generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
        do_sample=False, length_penalty=length_penalty, early_stopping=early_stopping, output_scores=True,
        return_dict_in_generate=True, pad_token_id=2,
    )
    results = []
    for row, score in zip(out.sequences, out.sequences_scores):
        tokens = row[len(prompt):].tolist()
        eos_at = tokens.index(1) if 1 in tokens else None  # shorter hypotheses are padded after their EOS
        results.append((tokens[: eos_at + 1] if eos_at is not None else tokens, float(score)))
    return results


def check_against_transformers(folder, mode_args: dict, searches: list[tuple]) -> dict:
    reference = load_reference(folder)
    llm = LLM(str(folder), **mode_args)
    seen = {"eos": 0, "early": 0, "waited": 0}
    engine, step = llm.llm_engine, llm.llm_engine.step

    def counted_step():
        outputs = step()
        seen["waited"] = max(seen["waited"], engine.get_stats()["num_waiting"])
        return outputs

    engine.step = counted_step
    for width, max_tokens, penalty, *stopping in searches:
        early_stopping = stopping[0] if stopping else False
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty, early_stopping=early_stopping)
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, output in zip(PROMPTS, outputs):
            theirs = transformers_beams(reference, prompt, width, max_tokens, penalty, early_stopping)
            ours = [(seq.tokens[len(prompt):], seq.score) for seq in output.sequences]
            assert [t for t, _ in ours] == [t for t, _ in theirs], f"width {width}, penalty {penalty}, prompt {prompt}"
            for (_, our_score), (_, their_score) in zip(ours, theirs):
                assert abs(our_score - their_score) < SCORE_TOLERANCE
            for seq in output.sequences:
                assert seq.tokens[: len(prompt)] == prompt
                assert abs(sum(next(iter(d.values())).logprob for d in seq.logprobs) - seq.cum_logprob) < 1e-6
            seen["eos"] += sum(seq.finish_reason == "stop" for seq in output.sequences)
            seen["early"] += all(len(t) < max_tokens for t, _ in ours)
    return seen


@pytest.mark.parametrize("mode", list(MODES))
def test_beams_equal_transformers_with_eos_endings(eos_model, mode):
    seen = check_against_transformers(eos_model, MODES[mode], SEARCHES if mode == "defaults" else SEARCHES[:1])
    assert seen["eos"] > 0 and seen["early"] > 0, f"the EOS paths were not exercised: {seen}"
    if mode.startswith("preempt"):
        assert seen["waited"] > 0, "the small pool held every beam of every round at once"


def test_early_stopping_true_and_never_equal_transformers(eos_model):
    """early_stopping=True ends a search when `width` hypotheses exist; "never" goes on while the
    best running beam could still win at max_tokens (length_penalty > 0): both as transformers."""
    seen = check_against_transformers(eos_model, MODES["defaults"], EARLY_STOPPING)
    assert seen["eos"] > 0 and seen["early"] > 0, f"the EOS paths were not exercised: {seen}"


def test_early_stopping_changes_the_search(eos_model):
    """The three rules give different searches on this model (else the test above proves little)."""
    llm = LLM(str(eos_model), block_size=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def search(width, max_tokens, penalty, rule):
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty, early_stopping=rule)
        return [[seq.tokens for seq in output.sequences] for output in llm.beam_search(prompts, params)]

    assert search(4, 16, 2.0, True) != search(4, 16, 2.0, False)
    assert search(2, 12, 2.0, False) != search(2, 12, 2.0, "never")


def test_beams_equal_transformers_llama(model_dir):
    check_against_transformers(model_dir("llama"), MODES["defaults"], SEARCHES[1:])


def test_beams_share_the_prompts_blocks_through_the_prefix_cache(model_dir):
    """Each round's beam requests run in one step and hold the prompt's full blocks once between
    them: their prefix-cache hits on the blocks earlier rounds published."""
    llm = LLM(str(model_dir("llama")), block_size=4)
    engine, prompt = llm.llm_engine, PROMPTS[3]  # 30 tokens: 7 full blocks and a partial one
    searcher = BeamSearcher(engine)
    searcher.add("beams", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=12))
    shared_steps = 0
    execute = engine.runner.execute

    def spy(sched):
        nonlocal shared_steps
        tables = list(engine.block_manager.tables.values())
        if len(tables) == 4:
            shared_steps += 1
            assert all(t[:7] == tables[0][:7] for t in tables), "beams should share the prompt's full blocks"
            used = engine.block_manager.num_used_blocks
            assert used < sum(len(t) for t in tables), "shared blocks must not be counted (copied) per beam"
        return execute(sched)

    engine.runner.execute = spy
    while searcher.has_unfinished():
        searcher.step()
    assert shared_steps > 5
    assert len(searcher.results["beams"].sequences) == 4


def test_beam_search_rejects_bad_parameters(model_dir):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
    for bad in ("always", 1, None):
        with pytest.raises(ValueError, match="early_stopping"):
            BeamSearchParams(beam_width=2, max_tokens=4, early_stopping=bad)
    llm = LLM(str(model_dir("llama")))
    with pytest.raises(ValueError, match="beam_width=11 is too wide"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=11, max_tokens=4))


def test_offline_rounds_step_off_the_main_thread_and_failures_come_back(model_dir, monkeypatch):
    """LLM.beam_search steps its rounds on a worker thread, as the server's engine loop does (on the
    main thread the step's OpenMP waiters spun against each other: 8.5-9.9 s against 1.0-1.2 s for
    one search, llm.py); a failure in a round reaches the caller and leaves no KV held (the autouse
    fixture checks every block is free)."""
    import threading

    llm = LLM(str(model_dir("llama")))
    threads = set()
    step = BeamSearcher.step

    def recording(self):
        threads.add(threading.current_thread() is threading.main_thread())
        return step(self)

    monkeypatch.setattr(BeamSearcher, "step", recording)
    (out,) = llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert threads == {False} and len(out.sequences) == 2
    calls = []

    def failing(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a round failed")
        return step(self)

    monkeypatch.setattr(BeamSearcher, "step", failing)
    with pytest.raises(RuntimeError, match="a round failed"):
        llm.beam_search([[5, 6, 7], [8, 9]], BeamSearchParams(beam_width=2, max_tokens=6))
    assert not llm.llm_engine.has_unfinished_requests()
