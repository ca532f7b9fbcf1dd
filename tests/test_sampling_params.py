"""Request validation (pagedllm/sampling_params.py): every bound accepted exactly at its edge and
refused just past it, with the message that names the field — the server's 400s and the engine's
ValueErrors are these messages. `make mutate` runs these tests against the module's mutants."""
from __future__ import annotations

import re

import pytest

from pagedllm.sampling_params import (BeamSearchParams, RequestOutputKind, SamplingParams,
                                      StructuredOutputsParams)

ACCEPTED = [
    dict(n=1), dict(n=3), dict(n=2, best_of=2), dict(n=2, best_of=5),
    dict(temperature=0), dict(temperature=0.0), dict(temperature=100.0), dict(temperature=100),
    dict(top_p=1.0), dict(top_p=1e-6), dict(top_p=1),
    dict(top_k=-1), dict(top_k=1), dict(top_k=50),
    dict(min_p=0.0), dict(min_p=1.0), dict(min_p=1),
    dict(presence_penalty=-2.0), dict(presence_penalty=2), dict(frequency_penalty=-2), dict(frequency_penalty=2.0),
    dict(repetition_penalty=0.01), dict(repetition_penalty=100.0), dict(repetition_penalty=1),
    dict(max_tokens=1), dict(max_tokens=None), dict(max_tokens=None, min_tokens=10**6),
    dict(min_tokens=0), dict(min_tokens=5, max_tokens=5),
    dict(logprobs=0), dict(prompt_logprobs=0), dict(logprobs=20, prompt_logprobs=20),
    dict(seed=0), dict(seed=-1), dict(seed=2**63),
    dict(stop="x"), dict(stop=["a", "b"]), dict(stop=[]), dict(stop_token_ids=[0, 5]), dict(stop_token_ids=[]),
    dict(logit_bias={0: -100, 5: 100.0, 7: 0}), dict(logit_bias={}),
    dict(allowed_token_ids=[0]), dict(allowed_token_ids=(3, 4)),
    dict(output_kind=RequestOutputKind.FINAL_ONLY), dict(output_kind=RequestOutputKind.CUMULATIVE),
    dict(structured_outputs=StructuredOutputsParams(regex="a+")),
]


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=repr)
def test_values_at_their_bounds_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("allowed_token_ids", "stop_token_ids"):
            assert getattr(params, name) == value


REFUSED = [
    (dict(n=0), "n must be an integer >= 1, got 0"),
    (dict(n=1.0), "n must be an integer >= 1, got 1.0"),
    (dict(n=True), "n must be an integer >= 1, got True"),
    (dict(best_of=0, n=1), "best_of must be an integer >= 1, got 0"),
    (dict(n=3, best_of=2), "best_of must be >= n, got best_of=2 and n=3"),
    (dict(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (dict(temperature=100.5), "temperature must be <= 100 (any higher is uniform sampling), got 100.5"),
    (dict(temperature=float("nan")), "temperature must be a number, got nan"),
    (dict(temperature="1"), "temperature must be a number, got '1'"),
    (dict(temperature=True), "temperature must be a number, got True"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.01), "top_p must be in (0, 1], got 1.01"),
    (dict(top_p=9e-7), "top_p must be in (0, 1] and at least 1e-06 (smaller rounds to 0), got 9e-07"),
    (dict(top_p=None), "top_p must be a number, got None"),
    (dict(top_k=0), "top_k must be -1 (disabled) or a positive integer, got 0"),
    (dict(top_k=-2), "top_k must be -1 (disabled) or a positive integer, got -2"),
    (dict(top_k=2.0), "top_k must be -1 (disabled) or a positive integer, got 2.0"),
    (dict(top_k=True), "top_k must be -1 (disabled) or a positive integer, got True"),
    (dict(min_p=-0.01), "min_p must be in [0, 1], got -0.01"),
    (dict(min_p=1.01), "min_p must be in [0, 1], got 1.01"),
    (dict(min_p="0"), "min_p must be a number, got '0'"),
    (dict(presence_penalty=-2.01), "presence_penalty must be in [-2, 2], got -2.01"),
    (dict(presence_penalty=2.01), "presence_penalty must be in [-2, 2], got 2.01"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2], got -2.01"),
    (dict(frequency_penalty=2.01), "frequency_penalty must be in [-2, 2], got 2.01"),
    (dict(frequency_penalty=None), "frequency_penalty must be a number, got None"),
    (dict(presence_penalty=None), "presence_penalty must be a number, got None"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0, got 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0, got -1.0"),
    (dict(repetition_penalty=0.0099), "repetition_penalty must be in [0.01, 100], got 0.0099"),
    (dict(repetition_penalty=100.5), "repetition_penalty must be in [0.01, 100], got 100.5"),
    (dict(repetition_penalty="1"), "repetition_penalty must be a number, got '1'"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0, got -1"),
    (dict(min_tokens=6, max_tokens=5), "min_tokens must be <= max_tokens, got min_tokens=6 and max_tokens=5"),
    (dict(logprobs=-1), "logprobs must be an integer >= 0, got -1"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer >= 0, got -1"),
    (dict(logprobs=1.5), "logprobs must be an integer >= 0, got 1.5"),
    (dict(seed=1.5), "seed must be an integer, got 1.5"),
    (dict(seed=True), "seed must be an integer, got True"),
    (dict(stop=[""]), "stop must be a non-empty string or a list of non-empty strings"),
    (dict(stop=""), "stop must be a non-empty string or a list of non-empty strings"),
    (dict(stop=["a", 3]), "stop must be a non-empty string or a list of non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative integers"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be non-negative integers"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be non-negative integers"),
    (dict(structured_outputs={"regex": "a"}), "structured_outputs must be a StructuredOutputsParams"),
    (dict(output_kind=RequestOutputKind.DELTA),
     "output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY, got <RequestOutputKind.DELTA: 1> (DELTA outputs are not supported)"),
    (dict(logit_bias=[(1, 2)]), "logit_bias must be a dict of token id -> bias, got list"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids (integers >= 0), got -1"),
    (dict(logit_bias={"1": 1.0}), "logit_bias keys must be token ids (integers >= 0), got '1'"),
    (dict(logit_bias={True: 1.0}), "logit_bias keys must be token ids (integers >= 0), got True"),
    (dict(logit_bias={1: 100.5}), "logit_bias values must be numbers in [-100, 100], got 100.5 for token 1"),
    (dict(logit_bias={1: -100.5}), "logit_bias values must be numbers in [-100, 100], got -100.5 for token 1"),
    (dict(logit_bias={1: "1"}), "logit_bias values must be numbers in [-100, 100], got '1' for token 1"),
    (dict(logit_bias={1: True}), "logit_bias values must be numbers in [-100, 100], got True for token 1"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids={1}), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids must be token ids (integers >= 0)"),
    (dict(allowed_token_ids=[False]), "allowed_token_ids must be token ids (integers >= 0)"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED, ids=[m for _, m in REFUSED])
def test_values_past_their_bounds_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**kwargs)


def test_derived_fields():
    """best_of defaults to n; stop becomes a list of stop strings; token lists become lists."""
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(stop="end").stop_strings == ["end"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams().stop_strings == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(allowed_token_ids=(3, 4)).allowed_token_ids == [3, 4]
    defaults = SamplingParams()
    assert (defaults.n, defaults.best_of, defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (1, 1, 1.0, 1.0, -1, 16)


def test_greedy_and_restricted_tokens():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams().restricts_tokens and not SamplingParams(logit_bias={}).restricts_tokens
    assert SamplingParams(logit_bias={1: 0.5}).restricts_tokens and SamplingParams(allowed_token_ids=[1]).restricts_tokens


STRUCTURED_REFUSED = [
    (dict(), "structured_outputs: need exactly one of ['json', 'regex', 'choice', 'grammar', 'json_object'], got none"),
    (dict(regex="a", grammar="b"),
     "structured_outputs: need exactly one of ['json', 'regex', 'choice', 'grammar', 'json_object'], got ['regex', 'grammar']"),
    (dict(json="{not json"), "structured_outputs: json is not a valid JSON schema document: "),
    (dict(json="[1]"), "structured_outputs: json must be a JSON schema object"),
    (dict(json=[1]), "structured_outputs: json must be a JSON schema object"),
    (dict(choice=[]), "structured_outputs: choice must be a non-empty list of non-empty strings"),
    (dict(choice="ab"), "structured_outputs: choice must be a non-empty list of non-empty strings"),
    (dict(choice=["a", ""]), "structured_outputs: choice must be a non-empty list of non-empty strings"),
    (dict(choice=["a", 1]), "structured_outputs: choice must be a non-empty list of non-empty strings"),
    (dict(regex=3), "structured_outputs: regex must be a non-empty string"),
    (dict(grammar=["start"]), "structured_outputs: grammar must be a non-empty string"),
]


@pytest.mark.parametrize("kwargs, message", STRUCTURED_REFUSED, ids=[m for _, m in STRUCTURED_REFUSED])
def test_structured_outputs_need_exactly_one_valid_constraint(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_accepted():
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputsParams(json={"type": "string"}).json == {"type": "string"}
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ["a", "b"]
    assert StructuredOutputsParams(grammar="start: /a/").grammar == "start: /a/"
    assert StructuredOutputsParams(json_object=True).json_object


BEAM_REFUSED = [
    (dict(beam_width=0, max_tokens=1), "beam_width must be an integer >= 1, got 0"),
    (dict(beam_width=1, max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(beam_width=1, max_tokens=1, temperature=0.5), "beam search is deterministic: temperature must be 0, got 0.5"),
    (dict(beam_width=1, max_tokens=1, temperature="0"), "temperature must be a number, got '0'"),
    (dict(beam_width=1, max_tokens=1, length_penalty=None), "length_penalty must be a number, got None"),
    (dict(beam_width=1, max_tokens=1, early_stopping="always"), 'early_stopping must be true, false or "never", got \'always\''),
]


@pytest.mark.parametrize("kwargs, message", BEAM_REFUSED, ids=[m for _, m in BEAM_REFUSED])
def test_beam_search_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        BeamSearchParams(**kwargs)


def test_beam_search_params_accepted():
    for early in (True, False, "never"):
        assert BeamSearchParams(beam_width=1, max_tokens=1, early_stopping=early).early_stopping == early
    params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=0)
    assert (params.temperature, params.length_penalty, params.ignore_eos) == (0.0, 0, False)
