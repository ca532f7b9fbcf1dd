"""Sampler building blocks against their formulas, and the sampling distribution itself."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.engine.sequence import Request, Sequence
from pagedllm.layers.sampler import Sampler, apply_penalties, filter_logits
from pagedllm.sampling_params import SamplingParams


def seq_with(params: SamplingParams, prompt=(0, 1), output=()) -> Sequence:
    request = Request("r", None, list(prompt), params, 0.0)
    seq = Sequence(request, 0, list(prompt) + list(output), request.new_generator(0, torch.device("cpu")))
    request.seqs.append(seq)
    return seq


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    seq = seq_with(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), prompt=(0,), output=(1, 2, 2))
    apply_penalties(logits, [0], [seq])
    # repetition on prompt+output tokens {0,1,2}: positive /2, negative *2; then output counts {1:1, 2:2}
    expected = [2.0 / 2, -2.0 * 2 - 0.25 * 1 - 0.5, 1.0 / 2 - 0.25 * 2 - 0.5, 0.5, 3.0]
    assert logits[0].tolist() == pytest.approx(expected)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda out: (out[0] > float("-inf")).tolist()  # noqa: E731
    assert kept(filter_logits(logits, [2], [1.0], [0.0])) == [True, True, False, False]
    assert kept(filter_logits(logits, [-1], [0.7], [0.0])) == [True, True, False, False]
    assert kept(filter_logits(logits, [-1], [0.5], [0.0])) == [True, False, False, False]
    assert kept(filter_logits(logits, [-1], [1.0], [0.3])) == [True, True, True, False]
    assert kept(filter_logits(logits, [-1], [0.01], [0.0])) == [True, False, False, False]


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    seqs = [seq_with(SamplingParams(temperature=1.0)) for _ in range(4000)]
    tokens = [r.token_id for r in Sampler(0, torch.device("cpu"))(logits, seqs)]
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    chi2 = float((((counts - 4000 * probs) ** 2) / (4000 * probs)).sum())
    assert chi2 < 16.3, (counts, chi2)  # p = 0.001 for 3 degrees of freedom


def test_temperature_sharpens_and_greedy_takes_argmax():
    logits = torch.tensor([[1.0, 1.5, 0.2]])
    greedy = Sampler(0, torch.device("cpu"))(logits, [seq_with(SamplingParams(temperature=0))])[0]
    assert greedy.token_id == 1 and greedy.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    cold = [seq_with(SamplingParams(temperature=0.05)) for _ in range(200)]
    tokens = {r.token_id for r in Sampler(1, torch.device("cpu"))(logits.repeat(200, 1), cold)}
    assert tokens == {1}


def test_min_tokens_bans_eos():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    seq = seq_with(params)
    seq.request.eos_token_ids = frozenset({0})
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    assert Sampler(0, torch.device("cpu"))(logits, [seq])[0].token_id == 1
    assert math.isfinite(Sampler(0, torch.device("cpu"))(logits, [seq])[0].logprob)
