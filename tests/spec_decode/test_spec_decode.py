"""Speculative decoding through the engine: greedy output token-identical to decoding without
it (and to transformers), every architecture, both proposers, every engine mode; sampled output
distributed as the target's (chi-square); metrics; errors."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import draft_vocab
from parity import MAX_TOKENS, MODES, PROMPTS, assert_matches, assert_mode_happened
from conftest import truncated_copy
from tiny_models import build_model

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SPEC_MODES = ("defaults", "prefix_caching", "chunked_prefill", "preempt_recompute", "preempt_swap")


def spec_config(method: str, draft) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    if method == "reduced_vocab":  # the draft scores half the vocabulary: the even ids, then the odd ones
        vocab = json.loads((draft / "config.json").read_text())["vocab_size"]
        draft_vocab.write(draft, list(range(0, vocab, 2)) + list(range(1, vocab, 2)), num_tokens=0)
        return {"model": str(draft), "num_speculative_tokens": 3, "draft_vocab_size": vocab // 2}
    return {"model": str(draft), "num_speculative_tokens": 3}


def greedy_tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def check_against(ours: list[list[int]], plain: list[list[int]], reference) -> None:
    assert ours == plain, "speculation changed greedy tokens"
    for tokens, (theirs, logits) in zip(ours, reference):
        assert_matches(tokens, theirs, logits)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "reduced_vocab"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_unchanged_by_speculation(arch, method, model_dir, draft_dir, reference):
    folder = str(model_dir(arch))
    plain = greedy_tokens(LLM(folder))
    llm = LLM(folder, speculative_config=spec_config(method, draft_dir(arch)))
    check_against(greedy_tokens(llm), plain, reference(arch))
    stats = llm.get_stats()
    # both paths of verification ran: some proposals accepted, some rejected
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(model_dir):
    """The engine-driven path's draft KV bookkeeping is exact — prompts mirrored, the tokens the
    target accepted caught up as decode rows, proposals fed back — so a draft that is the target
    itself proposes the target's own greedy tokens and every one is accepted; the catch-ups ran
    as fused steps. (Greedy decodes take fused cycles by default: test_fused_cycles.py.)"""
    folder = str(model_dir("llama"))
    llm = LLM(folder, speculative_config={"model": folder, "num_speculative_tokens": 3, "fused_cycles": False})
    prompt = PROMPTS[:1]  # one sequence: a draft step of several rows is a catch-up
    assert greedy_tokens(llm, prompt) == greedy_tokens(LLM(folder), prompt)
    stats = llm.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    draft = llm.llm_engine.runner.speculator.draft
    assert any(rows > 1 for rows in draft.model.fused.threads.times), "no catch-up ran as a fused step"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("mode", SPEC_MODES)
def test_greedy_is_unchanged_in_every_engine_mode(mode, method, model_dir, draft_dir, reference):
    folder = str(model_dir("llama"))
    plain = greedy_tokens(LLM(folder, **MODES[mode]))
    llm = LLM(folder, speculative_config=spec_config(method, draft_dir("llama")), **MODES[mode])
    runs = 2 if mode == "prefix_caching" else 1
    for _ in range(runs):
        check_against(greedy_tokens(llm), plain, reference("llama"))
    stats = llm.get_stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert_mode_happened(stats, mode)


def staggered(llm: LLM, lengths: list[int]) -> list[list[int]]:
    """Greedy tokens of PROMPTS[:len(lengths)], each stopping after its own length, so the
    running batch shrinks as they finish."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[: len(lengths)], params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_pauses_while_the_batch_is_large(method, model_dir, draft_dir):
    """disable_by_batch_size=2: while two or more sequences run nothing is proposed; once one
    is left it speculates again. Greedy tokens stay those of decoding without speculation."""
    folder = str(model_dir("llama"))
    config = {**spec_config(method, draft_dir("llama")), "disable_by_batch_size": 2}
    plain = LLM(folder)
    llm = LLM(folder, speculative_config=config)
    assert greedy_tokens(llm, PROMPTS[:4]) == greedy_tokens(plain, PROMPTS[:4])
    assert llm.get_stats()["spec_decode_num_drafts"] == 0, "proposals were verified in a batch of 4"
    lengths = [4, MAX_TOKENS]  # the second runs alone for its last 20 tokens
    assert staggered(llm, lengths) == staggered(plain, lengths)
    drafts = llm.get_stats()["spec_decode_num_drafts"]
    assert 0 < drafts <= MAX_TOKENS - 4, drafts


def test_a_paused_draft_catches_up_and_guards_the_prefix_cache(model_dir):
    """While speculation pauses the draft skips decodes and its KV lags. It catches up when
    proposals resume, so a draft equal to the target has every proposal accepted then; and a
    block reaches the prefix cache only once the draft's KV covers it, so a prompt that reuses
    the blocks of sequences that ran paused is proposed from complete KV as well."""
    folder = str(model_dir("llama"))
    config = {"model": folder, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    llm = LLM(folder, speculative_config=config, enable_prefix_caching=True, block_size=4)
    plain = LLM(folder, enable_prefix_caching=True, block_size=4)
    lengths = [10, MAX_TOKENS]
    assert staggered(llm, lengths) == staggered(plain, lengths)
    stats = llm.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]

    paused = greedy_tokens(llm, PROMPTS[2:4])  # two at once: no proposals, the draft skips their decodes
    assert llm.get_stats()["spec_decode_num_draft_tokens"] == stats["spec_decode_num_draft_tokens"]
    follow_up = [PROMPTS[2] + paused[0]]
    hits = llm.get_stats()["prefix_cache_hits"]
    assert greedy_tokens(llm, follow_up) == greedy_tokens(plain, follow_up)
    after = llm.get_stats()
    assert after["prefix_cache_hits"] > hits, "the follow-up did not reuse the paused sequence's blocks"
    assert after["spec_decode_num_draft_tokens"] > stats["spec_decode_num_draft_tokens"]
    assert after["spec_decode_num_accepted_tokens"] == after["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_a_draft_equal_to_the_target_accepts_everything_around_pauses(mode, model_dir):
    """Every prompt at once, each stopping at its own length, speculation pausing at 3 running
    sequences: through preemption (both kinds), chunked prefill and prefix-cache hits (a second
    pass) the draft's lagging KV is caught up exactly, so every proposal is accepted."""
    folder = str(model_dir("llama"))
    config = {"model": folder, "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    llm, plain = LLM(folder, speculative_config=config, **MODES[mode]), LLM(folder, **MODES[mode])
    lengths = [MAX_TOKENS - 2 * i for i in range(len(PROMPTS))]  # the last two run below the threshold
    for _ in range(2 if mode == "prefix_caching" else 1):
        assert staggered(llm, lengths) == staggered(plain, lengths)
    stats = llm.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert_mode_happened(stats, mode)


def test_seeded_samples_with_n_and_speculation_are_reproducible(model_dir, draft_dir):
    folder = str(model_dir("llama"))
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True, logprobs=1)
    config = spec_config("draft_model", draft_dir("llama"))
    alone = LLM(folder, speculative_config=config).generate([PROMPTS[1]], params, use_tqdm=False)[0]
    crowd = LLM(folder, speculative_config=config).generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[5]],
        [SamplingParams(temperature=1.0, max_tokens=15), params, SamplingParams(temperature=0, max_tokens=9)],
        use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    assert all(len(c.token_ids) == 20 and len(c.logprobs) == 20 for c in alone.outputs)


# ---- the sampled distribution -------------------------------------------------------------------
VOCAB = 12
PROMPT = [3, 5, 7, 3, 5, 7, 3]  # n-grams recur, so prompt lookup proposes
CHI2_999 = {5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59, 11: 31.26}  # p = 0.001, by degrees of freedom


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A target and a (1-layer) draft over 12 tokens, where distributions can be checked whole."""
    root = tmp_path_factory.mktemp("small-vocab")
    target = build_model(root / "target", "llama", seed=3, vocab_size=VOCAB, tokenizer=False, initializer_range=0.5)
    return target, truncated_copy(target, root / "draft")


def exact_marginal(folder, position: int, temperature: float, top_k: int) -> torch.Tensor:
    """The target's distribution of generated token `position` (0-based), summed over every
    path to it, with the same temperature and top-k the engine applies."""
    from tiny_models import load_reference

    model = load_reference(folder)
    paths, weights = torch.tensor([PROMPT]), torch.ones(1)
    with torch.inference_mode():
        for _ in range(position + 1):
            logits = model(paths).logits[:, -1].float() / temperature
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            probs = logits.masked_fill(logits < kth, float("-inf")).softmax(dim=-1)
            joint = weights[:, None] * probs
            if _ == position:
                return joint.sum(dim=0)
            paths = torch.cat([paths.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(paths))[:, None]], dim=1)
            weights = joint.reshape(-1)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "reduced_vocab"])
def test_sampled_tokens_follow_the_target_distribution(method, small_vocab):
    target, draft = small_vocab
    num = 3000
    llm = LLM(str(target), speculative_config=spec_config(method, draft), max_num_seqs=256, num_kv_blocks=4096)
    # seeds 10000 on: with 0..2999 position 2 fell past p = 0.001 (chi-square 32.8 > 29.6) for two
    # methods at once (their first tokens are the same draws) once the CPU drew by inverse transform;
    # the ranges from 5000, 10000, 20000 and 30000 passed for every method and position 0-3
    params = [SamplingParams(temperature=0.9, top_k=8, seed=10_000 + seed, max_tokens=5, ignore_eos=True) for seed in range(num)]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * num, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 100
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # rejections happened
    for position in (2, 3):  # tokens verified against proposals (the first decode step proposes)
        counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[position] for o in outputs]), minlength=VOCAB).float()
        expected = exact_marginal(target, position, 0.9, 8) * num
        rare = expected < 5  # pooled into one cell, as a chi-square test needs
        if rare.any():
            counts = torch.cat([counts[~rare], counts[rare].sum().view(1)])
            expected = torch.cat([expected[~rare], expected[rare].sum().view(1)])
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_999[len(counts) - 1], (position, counts.tolist(), expected.tolist())


def test_bad_speculative_config_is_a_clear_error(model_dir, small_vocab):
    folder = str(model_dir("llama"))
    for config, match in [
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
        ("{not json", "JSON"),
        ({"model": str(small_vocab[1]), "num_speculative_tokens": 2}, "vocab_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 8}, "draft model only"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "4"}, "disable_by_batch_size"),
        ({"model": str(model_dir("llama")), "num_speculative_tokens": 2, "draft_vocab_size": 8}, "draft_vocab.json"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(folder, speculative_config=config)
