"""Shared by the parity suites: the prompts, engine modes, transformers' greedy reference and
the near-tie rule.

A difference is accepted only where transformers' own logits for our token and its token are
within 1e-3 (a float near-tie); after such a divergence the trajectories no longer compare.
"""
from __future__ import annotations

import random

import torch

from tiny_models import load_reference

MAX_TOKENS = 24
NEAR_TIE = 1e-3


def make_prompts() -> list[list[int]]:
    """>= 8 prompts of different lengths; several share a 40-token prefix (prefix caching)."""
    rng = random.Random(1234)
    shared = [rng.randrange(3, 380) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 380) for _ in range(n)] for n in (1, 7, 20, 29)]
    prompts += [[rng.randrange(3, 380) for _ in range(n)] for n in (2, 11, 33, 57, 70)]
    return prompts


PROMPTS = make_prompts()


def make_reference(model_dir):
    """arch -> [(greedy tokens, raw logits per step)] from transformers, one prompt at a time
    (each arch computed once, when first asked for)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = load_reference(model_dir(arch))
            model.generation_config.eos_token_id = None  # run the full length, like ignore_eos
            results = []
            with torch.inference_mode():
                for prompt in PROMPTS:
                    out = model.generate(
                        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        output_logits=True, return_dict_in_generate=True, pad_token_id=2,
                    )
                    tokens = out.sequences[0, len(prompt):].tolist()
                    results.append((tokens, torch.cat(out.logits).float()))
            cache[arch] = results
        return cache[arch]

    return get


def assert_matches(ours: list[int], theirs: list[int], logits: torch.Tensor, near_tie: float = NEAR_TIE) -> int:
    """Returns how many leading positions agree exactly (all of them unless a near-tie)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            gap = float(logits[i, b] - logits[i, a])
            assert gap < near_tie, f"position {i}: we chose {a}, transformers {b}; logit gap {gap:.2e} is no near-tie"
            return i
    assert len(ours) == len(theirs)
    return len(ours)


def assert_outputs_match(outputs, expected, near_tie: float = NEAR_TIE, logprob_tol: float = 1e-4) -> None:
    """Each output's greedy tokens against transformers' (`expected`: make_reference's runs),
    and the chosen tokens' logprobs wherever the two agree."""
    for output, (tokens, logits) in zip(outputs, expected):
        completion = output.outputs[0]
        agreed = assert_matches(completion.token_ids, tokens, logits, near_tie)
        reference = torch.log_softmax(logits, dim=-1)
        for i in range(agreed):
            ours, theirs = completion.logprobs[i][tokens[i]].logprob, float(reference[i, tokens[i]])
            assert abs(ours - theirs) < logprob_tol, f"logprob at {i}: {ours} vs {theirs}"


MODES = {
    "defaults": {},
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=32),
    "preempt_recompute": dict(num_kv_blocks=12, preemption_mode="recompute"),
    "preempt_swap": dict(num_kv_blocks=12, preemption_mode="swap", swap_space=1 << 20),
    "block_size_1": dict(block_size=1),
    "block_size_16_no_chunking": dict(block_size=16, enable_chunked_prefill=False, enable_prefix_caching=False),
    "sdpa_decode": dict(attention_backend="sdpa"),
}


def assert_mode_happened(stats: dict, mode: str) -> None:
    """What the mode is there to exercise did happen (cache hits, preemptions, swaps)."""
    if mode == "prefix_caching":
        assert stats["prefix_cache_hits"] > 0
    if mode.startswith("preempt"):
        assert stats["num_preemptions"] > 0
    if mode == "preempt_swap":
        assert stats["num_swap_outs"] > 0
