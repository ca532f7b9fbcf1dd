"""Sampling through the engine: seeds, n/best_of via fork, stop conditions, logprobs."""
from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, LLMEngine, SamplingParams

PROMPT = "def parse(args):\n    "


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir("llama")))


def greedy_tokens(llm, prompt=PROMPT, n=24):
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
    return out.outputs[0]


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(model_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    alone = LLM(str(model_dir("llama"))).generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = ["import os\n", "class A:\n", "x = [1, 2, 3]\n" * 4, "# comment\n", PROMPT]
    crowd_params = [
        SamplingParams(temperature=0.8, max_tokens=30),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=25),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=18),
        SamplingParams(temperature=1.0, seed=43, max_tokens=20, ignore_eos=True),
    ]
    for engine_args in ({}, dict(max_num_batched_tokens=16), dict(num_kv_blocks=6, preemption_mode="swap", swap_space=1 << 20)):
        llm = LLM(str(model_dir("llama")), **engine_args)
        outs = llm.generate([*others[:2], PROMPT, *others[2:]], [*crowd_params[:2], seeded, *crowd_params[2:]], use_tqdm=False)
        assert outs[2].outputs[0].token_ids == alone, engine_args
    assert outs[-1].outputs[0].token_ids != alone  # another seed samples differently


def test_unseeded_sampling_follows_the_engine_seed(model_dir):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    first = LLM(str(model_dir("llama")), seed=3).generate([PROMPT] * 2, params, use_tqdm=False)
    again = LLM(str(model_dir("llama")), seed=3).generate([PROMPT] * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert first[0].outputs[0].token_ids != first[1].outputs[0].token_ids


def test_n_samples_share_the_prompt_blocks_through_fork(model_dir):
    engine = LLMEngine.from_engine_args(str(model_dir("llama")), block_size=4)
    engine.add_request("r", PROMPT, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True))
    engine.step()
    request = engine.requests["r"]
    tables = [engine.block_manager.block_table(s.seq_id) for s in request.seqs]
    assert len(tables) == 3
    full_blocks = len(request.prompt_token_ids) // 4
    assert full_blocks > 0 and tables[0][:full_blocks] == tables[1][:full_blocks] == tables[2][:full_blocks]
    assert all(engine.block_manager.ref_counts[b] == 3 for b in tables[0][:full_blocks])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    completions = outputs[0].outputs
    assert [c.index for c in completions] == [0, 1, 2] and all(len(c.token_ids) == 8 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1


def test_best_of_returns_the_n_most_likely(llm):
    """Seeded samples are the same whatever else runs (one generator per (seed, sample index)), so
    n=4 shows the four samples best_of=4 draws: n=1 of them returns the most likely, n=2 the two
    most likely in order — not sample 0, which is what best_of=1 returns (the seed is one whose
    most likely sample is not the first, so ignoring best_of fails)."""
    def generate(n, best_of):
        params = SamplingParams(n=n, best_of=best_of, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs

    every = generate(4, 4)
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)
    assert ranked[0].index != 0 and len({c.cumulative_logprob for c in every}) == 4
    first = generate(1, 1)
    assert first[0].token_ids == every[0].token_ids
    best = generate(1, 4)
    assert best[0].token_ids == ranked[0].token_ids and best[0].token_ids != first[0].token_ids
    two = generate(2, 4)
    assert [c.token_ids for c in two] == [c.token_ids for c in ranked[:2]]
    assert two[0].cumulative_logprob >= two[1].cumulative_logprob


def _boundary_stop(llm, completion) -> str:
    """A stop string made of the end of one token's text and the start of the next one's."""
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in completion.token_ids]
    for i in range(3, len(pieces) - 1):
        left, right = pieces[i], pieces[i + 1]
        if len(left) >= 2 and len(right) >= 1 and "\ufffd" not in left + right:
            candidate = left[-2:] + right[:1]
            if completion.text.count(candidate) == 1:
                return candidate
    raise AssertionError(f"no token boundary to build a stop string from in {pieces}")


def test_stop_string_spanning_tokens_is_never_returned(llm, model_dir):
    reference = greedy_tokens(llm)
    stop = _boundary_stop(llm, reference)
    engine = LLMEngine.from_engine_args(str(model_dir("llama")))
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            final = out.outputs[0]
    expected = reference.text[: reference.text.index(stop)]
    assert final.text == expected and final.finish_reason == "stop" and final.stop_reason == stop
    for earlier, later in zip(texts, texts[1:]):
        assert stop not in earlier and later.startswith(earlier)  # streamed text only grows


def test_stop_string_can_be_kept_on_request(llm):
    reference = greedy_tokens(llm)
    stop = _boundary_stop(llm, reference)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert out.outputs[0].text.endswith(stop)


def test_stop_token_ids_and_min_tokens(llm):
    tokens = greedy_tokens(llm).token_ids
    target = tokens[4]
    first = tokens.index(target)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop" and out.stop_reason == target
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target], min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6 and target not in out.token_ids[:6]  # banned below min_tokens
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == target and target not in out.token_ids[:-1]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24 and target not in out.token_ids


def test_eos_stops_unless_ignored(llm, model_dir, tmp_path):
    tokens = greedy_tokens(llm).token_ids
    folder = tmp_path / "eos-model"
    shutil.copytree(model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = tokens[3]
    (folder / "config.json").write_text(json.dumps(config))
    eos_llm = LLM(str(folder))
    stopped = eos_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == tokens[: tokens.index(tokens[3]) + 1]
    ignored = eos_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_max_model_len_ends_with_length(model_dir):
    llm = LLM(str(model_dir("llama")), max_model_len=40)
    prompt = list(range(5, 35))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_logprobs_top_n_and_ranks(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=2, max_tokens=10, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        top = sorted((lp for t, lp in entry.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
        assert entry[token].rank >= 1 and (entry[token].rank > 3 or entry[token].logprob == top[entry[token].rank - 1].logprob)
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_penalties_change_greedy_choices(llm):
    plain = greedy_tokens(llm, n=32).token_ids
    penalised = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.0), use_tqdm=False)[0].outputs[0].token_ids
    assert penalised != plain
    repeats = lambda ts: len(ts) - len(set(ts))  # noqa: E731
    assert repeats(penalised) <= repeats(plain)
