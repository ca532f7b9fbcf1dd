"""Sampler building blocks against their formulas, and the sampling distribution itself."""
from __future__ import annotations

import math
from dataclasses import replace
import re

import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata, apply_penalties, filter_logits
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampling_inputs import SampleRow, sampling_metadata, stage_sampling
from pagedllm.worker.staging import Staging

CPU = torch.device("cpu")


def kernel_library():
    from pagedllm.layers import kernels

    library = kernels.load()
    if library is None:
        pytest.skip("no C compiler")
    return library


def row_with(params: SamplingParams, prompt=(0, 1), output=(), eos=frozenset()) -> SampleRow:
    return SampleRow(0, 0, params, 0, list(prompt) + list(output), len(prompt), eos)


def metadata(rows: list[SampleRow]) -> SamplingMetadata:
    """What the runner builds for these rows (seeded rows get a fresh generator each)."""
    staging = Staging()
    plan = stage_sampling(rows, staging)
    return sampling_metadata(plan, staging.to(CPU), lambda row: torch.Generator().manual_seed(rows[row].params.seed))


def sample(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    return sampler(logits, metadata(rows)).token_ids.tolist()


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0], [2.0, -2.0, 1.0, 0.5, 3.0]])
    penalised = row_with(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), prompt=(0,), output=(1, 2, 2))
    plain = row_with(SamplingParams(), prompt=(0,), output=(1, 2, 2))
    out = apply_penalties(logits, metadata([penalised, plain]).penalties)
    # repetition on prompt+output tokens {0,1,2}: positive /2, negative *2; then output counts {1:1, 2:2}
    expected = [2.0 / 2, -2.0 * 2 - 0.25 * 1 - 0.5, 1.0 / 2 - 0.25 * 2 - 0.5, 0.5, 3.0]
    assert out[0].tolist() == pytest.approx(expected)
    assert torch.equal(out[1], logits[1])  # a row without penalties is untouched, bit for bit


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda out: (out[0] > float("-inf")).tolist()  # noqa: E731
    as_t = lambda v: torch.tensor([v])  # noqa: E731
    assert kept(filter_logits(logits, as_t(2), None, None)) == [True, True, False, False]
    assert kept(filter_logits(logits, None, as_t(0.7), None)) == [True, True, False, False]
    assert kept(filter_logits(logits, None, as_t(0.5), None)) == [True, False, False, False]
    assert kept(filter_logits(logits, None, None, as_t(0.3))) == [True, True, True, False]
    assert kept(filter_logits(logits, None, as_t(0.01), None)) == [True, False, False, False]
    assert kept(filter_logits(logits, as_t(10**9), as_t(1.0), as_t(0.0))) == [True] * 4  # "off" values


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_samples_follow_the_distribution(path):
    """The race's noise (torch) and the inverse transform's uniform numbers (the CPU kernel) from
    the engine's generator draw the tokens with their probabilities."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    rows = [row_with(SamplingParams(temperature=1.0)) for _ in range(4000)]
    tokens = sample(Sampler(0, CPU, kernel_library() if path == "kernel" else None), logits, rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    chi2 = float((((counts - 4000 * probs) ** 2) / (4000 * probs)).sum())
    assert chi2 < 16.3, (counts, chi2)  # p = 0.001 for 3 degrees of freedom


def test_temperature_sharpens_and_greedy_takes_argmax():
    logits = torch.tensor([[1.0, 1.5, 0.2]])
    greedy = Sampler(0, CPU)(logits, metadata([row_with(SamplingParams(temperature=0))]))
    assert greedy.token_ids.tolist() == [1] and float(greedy.logprobs[0]) == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    cold = [row_with(SamplingParams(temperature=0.05)) for _ in range(200)]
    assert set(sample(Sampler(1, CPU), logits.repeat(200, 1), cold)) == {1}


def test_min_tokens_bans_eos():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    row = row_with(params, eos=frozenset({0}))
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    out = Sampler(0, CPU)(logits, metadata([row]))
    assert out.token_ids.tolist() == [1] and math.isfinite(float(out.logprobs[0]))
    done = row_with(params, output=(3, 3), eos=frozenset({0}))  # min_tokens reached: EOS allowed again
    assert Sampler(0, CPU)(logits, metadata([done])).token_ids.tolist() == [0]


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_seeded_rows_draw_from_their_own_generator(path):
    library = kernel_library() if path == "kernel" else None
    seeded = SamplingParams(temperature=1.0, seed=11)
    rows = [row_with(SamplingParams(temperature=1.0)), row_with(seeded), row_with(SamplingParams(temperature=0))]
    logits = [torch.randn(3, 50, generator=torch.Generator().manual_seed(j)) for j in range(8)]
    alone = [sample(Sampler(0, CPU, library), x[1:2], [row_with(seeded)])[0] for x in logits]
    crowd = [sample(Sampler(5, CPU, library), x, rows) for x in logits]
    assert [c[1] for c in crowd] == alone and [c[2] for c in crowd] == [int(x[2].argmax()) for x in logits]
    assert len(set(alone)) > 1  # the seed's draws follow the logits: not a constant token


def test_plain_greedy_rows_take_the_argmax_with_its_raw_logprob():
    """The greedy fast path (no log-softmax of the whole vocabulary) gives what the general path gives."""
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)) * 4
    fast = Sampler(0, torch.device("cpu"))(logits, SamplingMetadata(5))
    general = Sampler(0, torch.device("cpu"))(logits, SamplingMetadata(5, max_num_logprobs=0))
    assert torch.equal(fast.token_ids, logits.argmax(dim=-1)) and torch.equal(fast.token_ids, general.token_ids)
    torch.testing.assert_close(fast.logprobs, general.logprobs, rtol=0, atol=1e-5)
    assert fast.ranks is None and general.ranks.tolist() == [1] * 5


@pytest.mark.parametrize("vocab", [1, 37, 200, 8192, 49152])
def test_the_greedy_kernel_matches_torch_argmax_and_logsumexp(vocab):
    """csrc/greedy.c against torch on the same rows: the first maximal index (ties, NaN counted as
    the maximum, as torch.argmax has it), and max - logsumexp within 1e-6 of float64 (torch's
    float32 logsumexp is itself ~1e-6 off at these sizes)."""
    from pagedllm.layers import kernels

    library = kernels.load()
    if library is None:
        pytest.skip("no C compiler")
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 6
    logits[1] = logits[1].round()  # ties (the first maximal index wins)
    logits[2, vocab // 2] = float("nan")
    logits[3] = float("-inf")
    logits[4, vocab - 1] = 50.0  # the maximum in the last lane (past the last whole block the search compares)
    logits[7, vocab // 3 :] = 40.0  # ties from the middle of a block to the end
    logits[5, : vocab - 1] = float("-inf")  # one finite logit: log-probability 0
    logits[6, vocab // 3] = float("inf")
    kernel = Sampler(0, CPU, library).greedy(logits)
    torch_rows = Sampler(0, CPU).greedy(logits)
    assert kernel.token_ids.tolist() == torch_rows.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    exact = logits.double().max(dim=-1).values - torch.logsumexp(logits.double(), dim=-1)
    # the sanitizer build (test_sanitizers.py) vectorises the instrumented sum differently: 1.1e-6 seen
    tolerance = 2e-6 if kernels.sanitizing() else 1e-6
    torch.testing.assert_close(kernel.logprobs.double(), exact, rtol=0, atol=tolerance, equal_nan=True)
    assert torch.equal(kernel.logprobs.isnan(), torch_rows.logprobs.isnan())
    assert float(kernel.logprobs[5]) == 0.0
    big = torch.randn(64, vocab, generator=torch.Generator().manual_seed(1)) * 6  # rows shared among threads
    kernel, torch_rows = Sampler(0, CPU, library).greedy(big), Sampler(0, CPU).greedy(big)
    assert torch.equal(kernel.token_ids, torch_rows.token_ids)
    torch.testing.assert_close(kernel.logprobs, torch_rows.logprobs, rtol=0, atol=1e-5)


# ---- cases found by mutation testing (issue 45, `make mutate`) --------------------------------------
def test_allowed_token_ids_then_logit_bias():
    from pagedllm.layers.sampler import TokenChoices, apply_token_choices

    logits = torch.arange(12, dtype=torch.float32).view(3, 4)
    choices = TokenChoices(restricted_rows=torch.tensor([0, 2]), allowed=(torch.tensor([0, 0, 2]), torch.tensor([1, 3, 0])),
                           bias=(torch.tensor([0, 1, 1]), torch.tensor([1, 2, 2])), bias_values=torch.tensor([0.5, 1.0, 2.0]))
    out = apply_token_choices(logits, choices)
    inf = float("-inf")
    assert out.tolist() == [[inf, 1.5, inf, 3.0], [4.0, 5.0, 9.0, 7.0], [8.0, inf, inf, inf]]  # repeated bias adds up
    assert logits[0, 0] == 0.0  # the input is left as it was
    assert torch.equal(apply_token_choices(logits, TokenChoices(None, None, None, None)), logits)


def test_a_grammar_bitmask_leaves_only_its_tokens():
    from pagedllm.layers.sampler import apply_allowed

    logits = torch.zeros(3, 40)
    # row 2 may take tokens 1, 3 and 33 (bit 1 of word 1); row 0 tokens 0 and 31
    bitmask = torch.tensor([[0b1010, 0b10], [1 | 1 << 31, 0]], dtype=torch.int64).to(torch.int32)  # bit 31: the sign bit
    out = apply_allowed(logits, torch.tensor([2, 0]), bitmask)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in out]
    assert allowed == [[0, 31], list(range(40)), [1, 3, 33]]


def test_greedy_rows_with_choices_or_a_grammar_take_the_masked_argmax():
    from pagedllm.layers.sampler import TokenChoices

    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 1.0, 0.0]])
    choices = TokenChoices(torch.tensor([0]), (torch.tensor([0, 0]), torch.tensor([1, 3])), None, None)
    assert Sampler(0, CPU)(logits, SamplingMetadata(2, choices=choices)).token_ids.tolist() == [3, 0]
    grammar = (torch.tensor([1]), torch.tensor([[0b0100]], dtype=torch.int32))  # row 1 may take token 2 only
    assert Sampler(0, CPU)(logits, SamplingMetadata(2, allowed=grammar)).token_ids.tolist() == [2, 2]


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_probs_apply_temperature_and_each_filter(path):
    sampler = Sampler(0, CPU, kernel_library() if path == "kernel" else None)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    base = dict(random_rows=torch.tensor([0, 1]), temperature=torch.tensor([1.0, 1.0]))
    probs = sampler.probs(logits, SamplingMetadata(2, **base, top_k=torch.tensor([2, 4])))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = sampler.probs(logits, SamplingMetadata(2, **base, top_p=torch.tensor([0.6, 1.0])))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = sampler.probs(logits, SamplingMetadata(2, **base, top_k=torch.tensor([3, 4]), top_p=torch.tensor([0.7, 1.0])))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]))  # top-p of the top 3
    probs = sampler.probs(logits, SamplingMetadata(2, **base, min_p=torch.tensor([0.5, 0.5])))  # keeps p >= 0.25 of row 0
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]))
    hot = sampler.probs(logits, SamplingMetadata(2, random_rows=torch.tensor([0]), temperature=torch.tensor([2.0])))
    torch.testing.assert_close(hot[0], torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt() / torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt().sum())


@pytest.mark.parametrize("top", [0, 1, 2])
def test_ranks_and_top_logprobs_as_many_as_asked(top):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    raw = torch.log_softmax(logits, dim=-1)
    out = Sampler.with_logprobs(raw, torch.tensor([3]), SamplingMetadata(1, max_num_logprobs=top))
    assert out.ranks.tolist() == [2] and out.logprobs.tolist() == [raw[0, 3].item()]
    if top == 0:
        assert out.top_ids is None and out.top_logprobs is None
    else:
        assert out.top_ids.tolist() == [[1, 3][:top]] and out.top_logprobs.tolist() == [raw[0, [1, 3][:top]].tolist()]
    assert Sampler.with_logprobs(raw, torch.tensor([3]), SamplingMetadata(1)).ranks is None


def test_unseeded_noise_comes_from_the_engines_generator():
    probs = torch.full((2, 50), 0.02)
    meta = SamplingMetadata(2, unseeded=torch.tensor([0, 1]))
    torch.manual_seed(0)
    first = Sampler(3, CPU).exponential_noise(probs, meta)
    torch.manual_seed(1)
    assert torch.equal(Sampler(3, CPU).exponential_noise(probs, meta), first)
    assert not torch.equal(Sampler(4, CPU).exponential_noise(probs, meta), first)


def test_the_noise_is_exp1_and_never_zero():
    """The exponential race draws exactly from p only with Exp(1) noise: mean and variance 1,
    P(E > 3) = e^-3; a zero would make p / E infinite (or NaN where p = 0)."""
    from pagedllm.layers.sampler import exponential_

    draws = exponential_(torch.empty(2_000_000), torch.Generator().manual_seed(5)).double()
    assert float(draws.min()) > 0 and torch.isfinite(draws).all()
    assert abs(float(draws.mean()) - 1) < 0.003 and abs(float(draws.var()) - 1) < 0.006
    assert abs(float((draws > 3).double().mean()) - math.exp(-3)) < 0.0008
    again = exponential_(torch.empty(2_000_000), torch.Generator().manual_seed(5)).double()
    assert torch.equal(draws, again)  # the generator's draws alone


class CountingLibrary:
    """The real kernel library, counting its greedy_rows (and nucleus_filter, sample_rows, token_logprobs) calls: which path a step took."""

    def __init__(self, library):
        self.library, self.calls, self.nucleus_calls, self.sample_calls, self.logprob_calls = library, 0, 0, 0, 0

    def greedy_rows(self, *args):
        self.calls += 1
        return self.library.greedy_rows(*args)

    def nucleus_filter(self, *args):
        self.nucleus_calls += 1
        return self.library.nucleus_filter(*args)

    def sample_rows(self, *args):
        self.sample_calls += 1
        return self.library.sample_rows(*args)

    def token_logprobs(self, *args):
        self.logprob_calls += 1
        return self.library.token_logprobs(*args)

    def __getattr__(self, name):
        return getattr(self.library, name)


def test_the_greedy_kernel_takes_float32_contiguous_cpu_rows_and_torch_the_rest():
    from pagedllm.layers import kernels

    library = kernels.load()
    if library is None:
        pytest.skip("no C compiler")
    counting = CountingLibrary(library)
    sampler = Sampler(0, CPU, counting)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    for rows, kernel_calls in [(logits, 1), (logits.double(), 1), (logits.t().contiguous().t(), 1), (logits[:, :32], 1)]:
        out = sampler.greedy(rows)
        assert counting.calls == kernel_calls and out.token_ids.tolist() == rows.argmax(dim=-1).tolist()
    assert sampler(logits, SamplingMetadata(4)).token_ids.tolist() == logits.argmax(dim=-1).tolist() and counting.calls == 2
    sampler(logits, SamplingMetadata(4, max_num_logprobs=0))  # the general path: ranks asked for
    assert counting.calls == 2


def test_a_grammar_bitmask_of_one_row_and_three_words():
    """Rows and words per row differ (the 2 x 2 case above cannot tell them apart)."""
    from pagedllm.layers.sampler import apply_allowed

    logits = torch.zeros(2, 70)
    bitmask = torch.tensor([[0b1, 0b100, 0b10]], dtype=torch.int32)  # tokens 0, 34 and 65
    out = apply_allowed(logits, torch.tensor([1]), bitmask)
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 34, 65] and torch.isfinite(out[0]).all()


def test_top_k_ranks_each_row_on_its_own():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))
    kept = filter_logits(logits, torch.tensor([1, 2]), None, None) > float("-inf")
    assert kept.tolist() == [[False, False, False, True], [True, True, False, False]]


def test_the_greedy_kernel_refuses_rows_without_logits_by_name():
    from pagedllm.layers import kernels

    library = kernels.load()
    if library is None:
        pytest.skip("no C compiler")
    with pytest.raises(kernels.KernelRefused, match=r"^greedy rows kernel refused its arguments: greedy rows: 2 rows of 0 logits"):
        Sampler(0, CPU, library).greedy(torch.empty(2, 0))


def exact_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, zone: float):
    """The filters' rule in float64, token by token: top-k keeps the logits >= the k-th largest (the
    sorted row's k-th entry), top-p then keeps a token while the probability mass of the logits
    strictly above it (of those top-k kept) is below p, so ties are kept or dropped together.
    Returns the filtered rows and where a token's mass above lies within `zone` of p (rounding)."""
    out, unsure = logits.clone(), torch.zeros_like(logits, dtype=torch.bool)
    for r, row in enumerate(logits):
        if not torch.isfinite(row.max()) or row.isnan().any():
            continue  # softmax of such a row is NaN: left as it is
        k = min(int(top_k[r]), row.numel())
        kept = row >= row.sort(descending=True).values[k - 1]
        if float(top_p[r]) < 1.0:
            probs = torch.where(kept, row.double(), float("-inf")).softmax(dim=-1)
            order = row.double().argsort(descending=True)
            ranked, mass = row.double()[order], probs[order]
            cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), mass.cumsum(dim=0)])
            first_of_value = torch.searchsorted(-ranked, -ranked, side="left")  # mass strictly above = before the first tie
            above = torch.empty_like(mass).index_copy_(0, order, cumulative[first_of_value])
            kept &= above < float(top_p[r])
            unsure[r] = (above - float(top_p[r])).abs() < zone
        out[r] = torch.where(kept, row, float("-inf"))
    return out, unsure


@pytest.mark.parametrize("vocab", [1, 37, 200, 3000, 49152])
def test_the_nucleus_kernel_keeps_what_the_filters_rule_keeps(vocab):
    """csrc/nucleus.c against the rule in float64: the k-th largest logit exactly (the value the
    torch path's sort gives), the nucleus token by token but for masses within 1e-6 of p (the
    kernel's exp is a float polynomial; torch's float32 cumsum was seen 1e-5 off). Ties, -inf
    logits, NaN, an infinite maximum, k of 1, of vocab - 1 and beyond, p off and tiny; rows shared
    among the threads."""
    from pagedllm.layers.sampler import nucleus_filter

    library = kernel_library()
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 8.0, rows).unsqueeze(1)
    logits[1] = logits[1].round()  # ties everywhere
    logits[2, ::3] = float("-inf")  # a grammar's mask
    logits[3, vocab // 2] = float("nan")
    logits[4, vocab // 3] = float("inf")
    logits[5] = float("-inf")
    logits[6] = 0.0  # one tie of the whole row
    logits[7] = logits[7].abs().neg()  # -0.0 and 0.0 next to each other
    logits[7, ::2] = 0.0
    top_k = torch.randint(1, vocab + 3, (rows,), generator=gen)
    top_k[:6] = torch.tensor([1, 2, max(vocab - 1, 1), vocab, vocab + 7, 2**62])
    top_p = torch.rand(rows, generator=gen) * 0.999 + 0.001
    top_p[8:14] = torch.tensor([1.0, 1e-4, 0.5, 0.9, 0.99, 0.999])
    top_k[8:12] = 2**62  # top-p alone
    top_k[14:16], top_p[14:16] = 3, 0.999  # top-p reaching the k-th logit: its mass counts
    expected, unsure = exact_filter(logits, top_k, top_p, zone=1e-6)
    both = nucleus_filter(logits, top_k, top_p, library)
    sure = ~unsure
    assert torch.equal(both[sure].isneginf(), expected[sure].isneginf())
    kept = ~both.isneginf()
    torch.testing.assert_close(both[kept], logits[kept], rtol=0, atol=0, equal_nan=True)  # what is kept is kept as it was
    assert unsure.sum() <= max(1, rows * vocab // 10000)  # the rounding zone stays a few tokens
    assert torch.equal(both[3].isnan(), logits[3].isnan()) and torch.equal(both[4], logits[4])  # NaN, inf: unfiltered
    # the wrapper hands the kernel int64 k and float32 p whatever the caller's dtypes
    narrow_k = top_k.clamp(max=vocab + 7).to(torch.int32)  # (any k >= vocab is off)
    assert torch.equal(nucleus_filter(logits, narrow_k, top_p.double(), library).isneginf(), both.isneginf())
    only_k = nucleus_filter(logits, top_k, None, library)
    only_p = nucleus_filter(logits, None, top_p, library)
    no_k = torch.full_like(top_k, 2**62)
    assert torch.equal(only_k.isneginf(), exact_filter(logits, top_k, torch.ones(rows), zone=0)[0].isneginf())
    assert torch.equal(only_k.isneginf(), filter_logits(logits, top_k, None, None).isneginf())  # the sort's k-th value
    expected_p, unsure_p = exact_filter(logits, no_k, top_p, zone=1e-6)
    assert torch.equal(only_p[~unsure_p].isneginf(), expected_p[~unsure_p].isneginf())


def test_the_nucleus_kernel_keeps_every_tie_at_the_top_p_boundary():
    """The torch path's sort keeps an arbitrary share of the logits tied at the boundary; the kernel
    keeps them all (as top-k keeps every logit tied with the k-th)."""
    from pagedllm.layers.sampler import nucleus_filter

    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    out = nucleus_filter(logits, None, torch.tensor([0.5]), kernel_library())
    assert out.isfinite().tolist() == [[True, True, True, True]]
    out = nucleus_filter(logits, None, torch.tensor([0.4]), kernel_library())
    assert out.isfinite().tolist() == [[True, False, False, False]]


def inverse_transform(logits: torch.Tensor, temperature: float, min_p: float, uniform: list[float], margin: float = 1e-4):
    """The tokens inverse transform sampling draws for each u of `uniform`, in float64: the first
    whose cumulative weight exp((x - max) / T) (weights under min_p dropped, and those float's exp
    takes to 0) exceeds u times the total. None where a rounding could move it: a weight within
    1e-5 of min_p, or u's point within `margin` (a share of the total) of the token's interval's
    ends (none for u = 0: the first token of positive weight)."""
    arg = (logits.double() - logits.double().max()) / temperature
    w = torch.where(arg < -87, 0.0, arg.exp())
    if min_p > 0 and ((w - min_p).abs() < 1e-5).any():
        return [None] * len(uniform)
    w = torch.where(w < min_p, 0.0, w)
    ends = w.cumsum(0) / w.sum()
    starts = ends - w / w.sum()
    tokens = torch.searchsorted(ends, torch.tensor(uniform, dtype=torch.float64), side="right").tolist()
    return [t if t < len(w) and (u == 0.0 or (u - float(starts[t]) >= margin and float(ends[t]) - u >= margin)) else None
            for t, u in zip(tokens, uniform)]


def draw(library, logits: torch.Tensor, rows, inverse, min_p, uniform, temperature=None, top_k=None, top_p=None) -> torch.Tensor:
    """The categorical kernel's tokens for draws (row, 1 / temperature, min_p, u; and where given
    the temperature, top_k and top_p a filtered draw reads)."""
    rows, uniform = torch.tensor(rows, dtype=torch.int64), torch.tensor(uniform, dtype=torch.float64)
    tensor = lambda values, dtype=torch.float32: None if values is None else torch.tensor(values, dtype=dtype)  # noqa: E731
    rule = [tensor(inverse), tensor(temperature), tensor(min_p), tensor(top_k, torch.int64), tensor(top_p)]
    tokens = torch.full((rows.numel(),), -1, dtype=torch.int64)
    status = library.sample_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.numel(), rows.data_ptr(),
                                 *(None if t is None else t.data_ptr() for t in rule), uniform.data_ptr(), rows.numel(),
                                 tokens.data_ptr(), tokens.numel(), 2)
    from pagedllm.layers import kernels

    kernels.check_status(status, library, "sample rows")
    return tokens


@pytest.mark.parametrize("vocab", [1, 37, 200, 3000, 49152])
def test_the_categorical_kernel_draws_the_token_whose_interval_holds_u(vocab):
    """csrc/categorical.c against inverse transform sampling in float64: for u at the middle of a
    token's interval (every token holding 1e-3 of the mass or more, and some at random) and at
    random, over temperatures, min_p, -inf masks and ties; u = 0 draws the first token of
    positive weight."""
    library = kernel_library()
    g = torch.Generator().manual_seed(vocab)
    checked = 0
    for case in range(12):
        x = (torch.randn(vocab, generator=g) * 3).float()
        if case % 3 == 1:
            x[torch.randperm(vocab, generator=g)[: vocab // 2]] = float("-inf")
        if case % 4 == 2:
            x = x.round()  # ties
        temperature, min_p = [1.0, 0.7, 0.1, 2.5][case % 4], [0.0, 0.02, 0.0, 0.3, 0.0, 1e-4][case % 6]
        arg = (x.double() - x.double().max()) / temperature
        w = torch.where((arg < -87) | (arg.exp() < min_p), 0.0, arg.exp())
        w = w / w.sum()
        ends, heavy = w.cumsum(0), (w >= 1e-3).nonzero().flatten()
        picks = torch.cat([heavy[:200], torch.randint(0, vocab, (20,), generator=g)])
        middles = [float(ends[t] - w[t] / 2) for t in picks if w[t] > 0]
        uniform = [u for u in middles if u < 1.0] + torch.rand(20, dtype=torch.float64, generator=g).tolist()
        uniform.append(0.0)
        tokens = draw(library, x.unsqueeze(0), [0] * len(uniform), [1 / temperature] * len(uniform), [min_p] * len(uniform), uniform)
        for u, token, expected in zip(uniform, tokens.tolist(), inverse_transform(x, temperature, min_p, uniform)):
            if expected is not None:
                assert token == expected, (case, u)
                checked += 1
            assert float(w[token]) > 0  # never a token of weight 0
    assert checked > 12 * 20


def test_the_categorical_kernel_gives_undefined_rows_token_0_and_takes_each_draws_row():
    """Rows whose softmax is undefined (a NaN, an infinite maximum, every logit -inf) give token 0,
    as torch's race does; each draw reads its own row, temperature and min_p, whatever the others;
    u just under 1 draws the last token of positive weight; a vocabulary past the kernel's
    1024 x 1024 stack of block sums takes wider blocks."""
    library = kernel_library()
    logits = torch.tensor([[0.0, 1.0, float("nan"), 2.0], [0.0, float("inf"), 1.0, float("inf")], [float("-inf")] * 4,
                           [0.0, 5.0, 0.0, float("-inf")], [3.0, 0.0, 0.0, 3.0]])
    tokens = draw(library, logits, [0, 1, 2, 3, 3, 4, 4, 3], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0], [0.0] * 8,
                  [0.5, 0.5, 0.5, 0.0, 1 - 2**-53, 0.3, 0.7, 0.99])
    assert tokens.tolist() == [0, 0, 0, 0, 2, 0, 3, 1]
    assert draw(library, logits[3:4], [0, 0], [1.0, 1.0], [0.0, 0.01], [1 - 2**-53] * 2).tolist() == [2, 1]
    wide = torch.full((1, 1024 * 1024 + 5), float("-inf"))
    wide[0, [3, 600_000, 1024 * 1024 + 4]] = torch.tensor([0.0, 0.0, 0.0])
    assert draw(library, wide, [0, 0, 0, 0], [1.0] * 4, None, [0.1, 0.5, 0.9, 1 - 2**-53]).tolist() == [3, 600_000, 1024 * 1024 + 4,
                                                                                                       1024 * 1024 + 4]


def test_random_rows_on_the_cpu_take_the_kernels_and_seeded_rows_draw_their_generators_numbers():
    """Random float32 CPU rows are drawn in one categorical kernel call, top-k / top-p rows divided
    by their temperature and filtered in it by the nucleus selection (no sort); a seeded row's token
    is inverse transform sampling of its generator's first float64 number on the filtered row at
    temperature 1 — every draw the same, the same drawn alone as beside other rules, and the torch
    path's token (no boundary within rounding in these rows)."""
    counting = CountingLibrary(kernel_library())
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=5), SamplingParams(temperature=1.0, top_k=40, seed=6),
              SamplingParams(temperature=0.9, top_k=100, top_p=0.8, min_p=0.01, seed=7), SamplingParams(temperature=0)]
    rows = [row_with(p) for p in params]
    tokens = [sample(Sampler(0, CPU, counting), logits, rows) for _ in range(20)]
    assert counting.nucleus_calls == 0 and counting.sample_calls == 20  # filtered in the draws' own call
    assert sample(Sampler(0, CPU), logits, rows) == tokens[0]  # torch's sorts and inverse transform: the same tokens
    assert len({tuple(t) for t in tokens}) == 1 and tokens[0][3] == int(logits[3].argmax())  # seeded: every draw the same
    alone = [sample(Sampler(0, CPU, counting), logits[r : r + 1], [rows[r]])[0] for r in range(3)]
    assert alone == tokens[0][:3]  # a row's rule is its own: the others' filters do not touch it
    # the kernel gets int64 k and float32 temperatures, p and min_p whatever the metadata's dtypes (k off: >= vocab)
    meta = metadata(rows)
    wide = replace(meta, temperature=meta.temperature.double(), top_k=meta.top_k.clamp(max=5000).int(),
                   top_p=meta.top_p.double(), min_p=meta.min_p.double())
    assert Sampler(0, CPU, counting)(logits, wide).token_ids.tolist() == tokens[0]
    filtered, _ = exact_filter(logits[:3] / torch.tensor([[0.7], [1.0], [0.9]]), torch.tensor([5000, 40, 100]),
                               torch.tensor([0.9, 1.0, 0.8]), 0.0)
    checked = 0
    for seed in range(10, 26):  # many seeds: a filter dropped or min_p ignored moves some of the draws
        seeded = [replace(p, seed=seed + r) for r, p in enumerate(params[:3])]
        drawn = sample(Sampler(0, CPU, counting), logits[:3], [row_with(p) for p in seeded])
        for r, p in enumerate(seeded):
            u = float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(p.seed)))
            expected = inverse_transform(filtered[r], 1.0, p.min_p, [u])[0]
            if expected is not None:
                assert drawn[r] == expected, (r, seed)
                checked += 1
    for seed in range(10, 26):  # min_p alone, applied in the categorical kernel
        params_min_p = SamplingParams(temperature=1.2, min_p=0.2, seed=seed)
        drawn = sample(Sampler(0, CPU, counting), logits[1:2], [row_with(params_min_p)])[0]
        u = float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
        expected = inverse_transform(logits[1], 1.2, 0.2, [u])[0]
        if expected is not None:
            assert drawn == expected, seed
            checked += 1
    assert checked >= 50
    counting.nucleus_calls = counting.sample_calls = 0
    sampler = Sampler(0, CPU, counting)
    sampler(logits.double(), metadata(rows))  # not float32: torch's rule, no kernel
    sampler(logits[3:], metadata(rows[3:]))  # greedy alone: the greedy kernel
    assert counting.sample_calls == 0 and counting.nucleus_calls == 0
    for alone in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7, top_k=9),
                  SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, min_p=0.2)):
        sample(sampler, logits[:1], [row_with(alone)])  # a filter or none: one sample_rows call, no nucleus call
        assert counting.nucleus_calls == 0, alone
        meta = metadata([row_with(alone)])  # the distribution speculative decoding reads: the nucleus kernel where it filters
        torch.testing.assert_close(sampler.probs(logits[:1], meta), Sampler(0, CPU).probs(logits[:1], meta), rtol=0, atol=1e-6)
        assert counting.nucleus_calls == (alone.top_p < 1 or alone.top_k > 0), alone
        counting.nucleus_calls = 0
    assert counting.sample_calls == 4


@pytest.mark.parametrize("vocab", [1, 37, 49152])
def test_the_token_logprobs_kernel_reads_the_log_softmax_at_each_rows_token(vocab):
    """csrc/greedy.c's token_logprobs against torch's log_softmax gathered at each row's token:
    rows with -inf logits, a NaN, an infinite maximum or every logit -inf (NaN, as torch gives),
    and a token of -1 (token 0's value, which the caller drops)."""
    library = kernel_library()
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    logits[1, : vocab // 2] = float("-inf")
    logits[2, 0], logits[3, -1], logits[4] = float("nan"), float("inf"), float("-inf")
    tokens = torch.randint(0, vocab, (7,), generator=torch.Generator().manual_seed(1))
    tokens[1], tokens[5] = vocab - 1, -1
    out = Sampler(0, CPU, library).token_logprobs(logits, tokens)
    expected = torch.log_softmax(logits, dim=-1).gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5, equal_nan=True)
    assert out[2:5].isnan().all() and not out[[0, 1, 5, 6]].isnan().any()


def test_random_rows_on_the_cpu_return_their_tokens_raw_logprobs_and_the_kernels_refuse_by_name():
    """With no logprobs asked for, CPU rows' chosen logprobs come from the kernel (no log-softmax of
    every row): those of the raw logits, before temperature and penalties, as the torch path gives."""
    from pagedllm.layers import kernels

    counting = CountingLibrary(kernel_library())
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(4)) * 3
    rows = [row_with(SamplingParams(temperature=0.6, seed=3, repetition_penalty=1.3)), row_with(SamplingParams(temperature=0)),
            row_with(SamplingParams(temperature=1.4, top_p=0.5, seed=4))]
    out = Sampler(0, CPU, counting)(logits, metadata(rows))
    raw = torch.log_softmax(logits, dim=-1).gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, raw, rtol=0, atol=1e-5)
    assert counting.logprob_calls == 1 and out.ranks is None
    asked = [row_with(SamplingParams(temperature=0.6, seed=3, logprobs=2))]
    assert Sampler(0, CPU, counting)(logits[:1], metadata(asked)).top_ids.shape == (1, 2) and counting.logprob_calls == 1
    with pytest.raises(kernels.KernelRefused, match=r"^token logprobs kernel refused its arguments: token logprobs: row 0's token 3000 of a"):
        Sampler(0, CPU, counting.library).token_logprobs(logits[:1], torch.tensor([3000]))
    with pytest.raises(kernels.KernelRefused, match=r"^sample rows kernel refused its arguments: sample rows: draw 0 reads row 3 of 3"):
        draw(counting.library, logits, [3], [1.0], None, [0.5])
    for inverse, min_p, u, said in ((0.0, 0.0, 0.5, "at 1 / temperature 0"), (float("inf"), 0.0, 0.5, "at 1 / temperature inf"),
                                    (1.0, 1.5, 0.5, "with min_p 1.5"), (1.0, 0.0, 1.0, "of uniform 1, outside"),
                                    (1.0, 0.0, -0.1, "of uniform -0.1, outside")):
        with pytest.raises(kernels.KernelRefused, match=f"sample rows: draw 0 {re.escape(said)}"):
            draw(counting.library, logits, [0], [inverse], [min_p], [u])
    for temperature, top_k, top_p, said in ((1.0, 0, 1.0, "with top_k 0, top_p 1"), (1.0, 5, 0.0, "with top_k 5, top_p 0"),
                                            (1.0, 5, float("nan"), "with top_k 5, top_p nan"),
                                            (0.0, 5, 1.0, "filtered (top_k 5, top_p 1) at temperature 0"),
                                            (float("nan"), 10**9, 0.5, "filtered (top_k 1000000000, top_p 0.5) at temperature nan")):
        with pytest.raises(kernels.KernelRefused, match=f"sample rows: draw 0 {re.escape(said)}"):
            draw(counting.library, logits, [0], [1.0], None, [0.5], [temperature], [top_k], [top_p])
    assert draw(counting.library, logits, [0], [1.0], None, [0.5], [0.0], [10**9], [1.0]).tolist()[0] >= 0  # unfiltered: unread


def test_torchs_inverse_transform_draws_the_kernels_tokens():
    """The torch path (any device) draws by the same rule as the CPU kernel: for u at the middle of
    each heavy token's interval the same token, never a token of probability 0 (u just under 1: the
    last positive one), token 0 for a row with NaN."""
    from pagedllm.layers.sampler import inverse_transform

    library = kernel_library()
    logits = torch.randn(2, 3000, generator=torch.Generator().manual_seed(8)) * 3
    logits[1, 1500:] = float("-inf")
    for r in range(2):
        probs = logits[r].double().softmax(dim=-1)
        heavy = (probs >= 1e-3).nonzero().flatten()
        uniform = (probs.cumsum(0)[heavy] - probs[heavy] / 2).tolist()
        torch_tokens = inverse_transform(logits[r:r + 1].softmax(dim=-1).repeat(len(uniform), 1), torch.tensor(uniform, dtype=torch.float64))
        kernel_tokens = draw(library, logits, [r] * len(uniform), [1.0] * len(uniform), None, uniform)
        assert torch_tokens.tolist() == kernel_tokens.tolist() == heavy.tolist()
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.0, 0.75, 0.0], [float("nan")] * 4])
    assert inverse_transform(probs, torch.tensor([1 - 2**-53, 1 - 2**-53, 0.5], dtype=torch.float64)).tolist() == [1, 2, 0]
    assert inverse_transform(probs[:2], torch.tensor([0.0, 0.3], dtype=torch.float64)).tolist() == [0, 2]
    # an interval's end and u = 0 before a token of probability 0: the next token of positive probability
    edges = torch.tensor([[0.25, 0.0, 0.75, 0.0], [0.0, 0.5, 0.5, 0.0]])
    assert inverse_transform(edges, torch.tensor([0.25, 0.0], dtype=torch.float64)).tolist() == [2, 1]
    # weights that do not sum to 1 are scaled by their total; the sums are float64's (in float32 the
    # 1e-9 weights after 0.5 would vanish and u would land past them)
    assert inverse_transform(torch.tensor([[1.0, 3.0]]), torch.tensor([0.5], dtype=torch.float64)).tolist() == [1]
    tiny = torch.tensor([[0.5] + [1e-9] * 1000 + [0.5 - 1e-6]])
    u = (0.5 + 500.5e-9) / float(tiny.double().sum())
    assert inverse_transform(tiny, torch.tensor([u], dtype=torch.float64)).tolist() == [501]


def test_a_refused_draw_names_the_sample_rows_kernel():
    from pagedllm.layers import kernels

    meta = SamplingMetadata(1, random_rows=torch.tensor([0]), temperature=torch.tensor([0.0]), unseeded=torch.tensor([0]))
    with pytest.raises(kernels.KernelRefused, match=r"^sample rows kernel refused its arguments: sample rows: draw 0 at 1 / temperature inf"):
        Sampler(0, CPU, kernel_library())(torch.zeros(1, 8), meta)


def test_seeded_noise_comes_from_each_rows_own_generator():
    """The race's noise, which speculative decoding's draft draws with: a seeded position's from
    its own generator, as exponential_ gives it."""
    from pagedllm.layers.sampler import exponential_

    probs = torch.full((2, 50), 0.02)
    meta = SamplingMetadata(2, unseeded=torch.tensor([0]), seeded=[(1, torch.Generator().manual_seed(9))])
    noise = Sampler(3, CPU).exponential_noise(probs, meta)
    assert torch.equal(noise[1], exponential_(torch.empty(50), torch.Generator().manual_seed(9)))
    assert torch.equal(noise[0], exponential_(torch.empty(1, 50), torch.Generator().manual_seed(3))[0])


def test_unseeded_uniform_numbers_come_from_the_engines_generator():
    meta = SamplingMetadata(3, random_rows=torch.tensor([0, 2]), temperature=torch.ones(2), unseeded=torch.tensor([0, 1]))
    torch.manual_seed(0)
    first = Sampler(3, CPU).uniform_draws(meta)
    torch.manual_seed(1)
    assert torch.equal(Sampler(3, CPU).uniform_draws(meta), first) and first.dtype == torch.float64
    assert torch.equal(first, torch.rand(2, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    assert not torch.equal(Sampler(4, CPU).uniform_draws(meta), first)


def test_the_nucleus_filter_raises_the_kernels_refusal_by_name():
    from pagedllm.layers import kernels
    from pagedllm.layers.sampler import nucleus_filter

    with pytest.raises(kernels.KernelRefused, match=r"^nucleus filter kernel refused its arguments: nucleus filter: 2 rows of 0 logits"):
        nucleus_filter(torch.empty(2, 0), None, torch.full((2,), 0.5), kernel_library())


def test_the_nucleus_kernel_refuses_rows_past_its_buffers_by_name():
    from pagedllm.layers import kernels

    library = kernel_library()
    logits, out = torch.zeros(2, 10), torch.zeros(1, 10)
    status = library.nucleus_filter(logits.data_ptr(), 2, 10, logits.numel(), None, None, out.data_ptr(), out.numel(), 1)
    with pytest.raises(kernels.KernelRefused, match=r"nucleus filter: 2 rows of 10 logits do not fit 20 floats in or 10 out"):
        kernels.check_status(status, library, "nucleus filter")
