"""logit_bias and allowed_token_ids: applied to the logits before sampling (greedy too), on every
way a step can run. The fused paths that take the argmax in C (multi-step bursts, fused
speculation cycles) cannot apply them, so the planner keeps such requests off them; the fused
single decode step hands its logits to the sampler, and speculative verification compares the
proposals with the biased argmax."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.step.planner import plain_greedy_decode

PROMPT = [5, 17, 42, 9, 120, 33, 8]
OTHER = [77, 3, 250, 11, 64]
N = 12


def same_model_draft(folder) -> dict:
    return {"model": str(folder), "num_speculative_tokens": 3}


# engine modes: the modules only; the fused decode step with multi-step bursts; n-gram
# speculation; a draft model (the target itself) with fused speculation cycles
MODES = {
    "torch": lambda folder: dict(decode_backend="torch"),
    "fused_multi_step": lambda folder: dict(decode_backend="fused", num_scheduler_steps=8),
    "ngram": lambda folder: dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
    "fused_cycles": lambda folder: dict(speculative_config=same_model_draft(folder), num_scheduler_steps=4),
}


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def baseline(model_dir):
    """Unbiased greedy tokens of both prompts (the modules, no speculation)."""
    llm = LLM(str(model_dir("llama")), decode_backend="torch")
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT, OTHER], greedy(), use_tqdm=False)]


@pytest.mark.parametrize("mode", list(MODES))
def test_bias_and_allowed_tokens_on_every_path(model_dir, baseline, mode):
    folder = model_dir("llama")
    llm = LLM(str(folder), **MODES[mode](folder))
    plain, other = baseline
    forced = next(t for t in range(300, 400) if t not in plain)
    allowed = [plain[0], forced, 7, 250]
    cases = [
        greedy(logit_bias={forced: 100.0}),  # +100 forces a token
        greedy(logit_bias={plain[0]: -100.0}),  # -100 bans the greedy token
        greedy(allowed_token_ids=allowed),
        greedy(allowed_token_ids=allowed, logit_bias={forced: -100.0}),
        greedy(),
    ]
    # each biased request shares its steps with an unbiased one, which must stay as it was
    prompts = [PROMPT] * len(cases) + [OTHER]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, cases + [greedy()], use_tqdm=False)]
    assert outputs[0] == [forced] * N, mode
    assert outputs[1][0] != plain[0], mode
    assert set(outputs[2]) <= set(allowed) and outputs[2][0] == plain[0], mode
    assert set(outputs[3]) <= set(allowed) - {forced}, mode
    assert outputs[4] == plain and outputs[5] == other, mode
    # a request alone in the engine (where a burst or fused cycle would otherwise run) too
    alone = llm.generate([PROMPT], greedy(logit_bias={forced: 100.0}), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == [forced] * N, mode


def test_a_biased_request_is_not_a_plain_greedy_decode():
    """The planner's test for bursts and fused cycles: a bias or an allowed list rules them out."""

    class Seq:
        num_tokens, num_computed_tokens, num_output_tokens = 10, 9, 1
        spec_token_ids: list = []
        grammar = None

        def __init__(self, params):
            self.params = params

    assert plain_greedy_decode(Seq(greedy()))
    assert not plain_greedy_decode(Seq(greedy(logit_bias={5: 1.0})))
    assert not plain_greedy_decode(Seq(greedy(allowed_token_ids=[5])))
    assert plain_greedy_decode(Seq(greedy(logit_bias={})))  # an empty bias changes nothing


def test_bias_shifts_sampling_and_keeps_logprobs_raw(model_dir, baseline):
    llm = LLM(str(model_dir("llama")))
    plain = baseline[0]
    allowed = [plain[0], 300, 301]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed)
    assert set(llm.generate([PROMPT], sampled, use_tqdm=False)[0].outputs[0].token_ids) <= set(allowed)
    # logprobs are the raw model's (before bias), as vLLM returns them by default
    raw = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)[0].outputs[0]
    forced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=0, logit_bias={300: 100}),
                          use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [300]
    assert forced.logprobs[0][300].logprob < raw.logprobs[0][plain[0]].logprob


def test_bad_values_are_refused(model_dir):
    for bad, match in [({-1: 1.0}, "logit_bias keys"), ({"5": 1.0}, "logit_bias keys"), ({5: 101}, "logit_bias values"),
                       ({5: float("nan")}, "logit_bias values"), ([5], "logit_bias must be a dict")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(logit_bias=bad)
    for bad in ([], [-1], [True], "5"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    llm = LLM(str(model_dir("llama")))
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias: token id {vocab} is outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids: token id"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[1, vocab + 5]), use_tqdm=False)
