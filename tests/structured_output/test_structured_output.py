"""Grammar-constrained decoding through the engine: outputs always parse or match, for several
JSON schemas, any JSON object, regexes, choices and a Lark grammar; constrained rows leave their
neighbours alone; samples forked with n > 1 keep grammars of their own; bad constraints are
clear errors."""
from __future__ import annotations

import json
import re

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams as Constraint
from pagedllm.paths import TINY_MODEL

PROMPTS = ["def parse(args):\n    ", "import os\n", "class Shape:\n"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
                                               "required": ["id", "email"], "additionalProperties": False},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["user", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir("llama")))


def generate(llm, constraint: Constraint, temperature: float = 0.9, n: int = 1, max_tokens: int = 160) -> list:
    params = [SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=max_tokens, structured_outputs=constraint)
              for seed in range(len(PROMPTS))]
    return [c for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]


def validate(value, schema: dict) -> None:
    """Enough of JSON schema for the schemas above."""
    kind = schema.get("type")
    if "enum" in schema:
        assert value in schema["enum"]
    elif kind == "object":
        assert isinstance(value, dict) and set(value) == set(schema["required"])
        for key, sub in schema["properties"].items():
            validate(value[key], sub)
    elif kind == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
        for item in value:
            validate(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
        if "pattern" in schema:
            assert re.search(schema["pattern"], value)
    elif kind in ("integer", "number"):
        assert isinstance(value, int if kind == "integer" else (int, float)) and not isinstance(value, bool)
        assert value >= schema.get("minimum", value) and value <= schema.get("maximum", value)  # bounds only where given
    elif kind == "boolean":
        assert isinstance(value, bool)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_parse_and_validate(llm, schema):
    for completion in generate(llm, Constraint(json=schema)):
        assert completion.finish_reason == "stop", completion.text
        validate(json.loads(completion.text), schema)


def is_json_prefix(text: str, close: bool = True) -> bool:
    """True when `text` is a JSON document cut short: the standard parser fails only because the
    input ends (an unterminated string is closed and checked again, with an escape cut short —
    a trailing backslash, a \\u and up to three hex digits — completed first)."""
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError as error:
        if close and error.msg.startswith(("Unterminated string", "Invalid \\uXXXX escape")):
            return any(is_json_prefix(text + tail, close=False) for tail in ('"', 'n"', '0"', '00"', '000"', '0000"'))
        return error.pos == len(text)


def test_any_json_object():
    """The trained default model at several temperatures: an answer that stops is one JSON object;
    one cut by max_tokens is a prefix of one. Both kinds occur, so both checks run."""
    llm = LLM(str(TINY_MODEL))
    prompts = PROMPTS + ["config = ", "x = "]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, structured_outputs=Constraint(json_object=True))
              for t in (0.0, 0.7, 1.0) for i in range(len(prompts))]
    completions = [o.outputs[0] for o in llm.generate(prompts * 3, params, use_tqdm=False)]
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    for completion in completions:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict), completion.text
        else:
            assert completion.text.startswith("{") and is_json_prefix(completion.text), completion.text
    assert not is_json_prefix('{"a": 1}}') and not is_json_prefix('{"a" 1') and not is_json_prefix('{"a": "\\x')
    assert not is_json_prefix('{"a": "\\u00zz') and not is_json_prefix('{"a": "b" "c')
    assert is_json_prefix('{"a": "b\\') and is_json_prefix('{"a": "\\u00') and is_json_prefix('{"a": "\\\\')


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no|maybe), (because|since) [a-z]{1,6}\.", r"0x[0-9a-f]{4}"])
def test_regex_outputs_match(llm, pattern):
    for completion in generate(llm, Constraint(regex=pattern)):
        assert re.fullmatch(pattern, completion.text), completion.text


def test_choice_and_lark_grammar(llm):
    choices = ["red", "green", "blue", "dark \"purple\""]
    assert {c.text for c in generate(llm, Constraint(choice=choices), n=4)} <= set(choices)
    grammar = 'start: call\ncall: NAME "(" (NUM ("," NUM)*)? ")"\nNAME: /[a-z]{1,6}/\nNUM: /[1-9][0-9]?/'
    for completion in generate(llm, Constraint(grammar=grammar)):
        assert re.fullmatch(r"[a-z]{1,6}\((?:[1-9][0-9]?(?:,[1-9][0-9]?)*)?\)", completion.text), completion.text


def test_forked_samples_and_neighbours(llm):
    """n = 3 samples each follow the grammar (their matchers are copies); an unconstrained
    greedy request in the same batch gets the tokens it gets alone."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=80, structured_outputs=Constraint(json=SCHEMAS[1]))
    both = llm.generate([PROMPTS[1], PROMPTS[0]], [constrained, greedy], use_tqdm=False)
    assert both[1].outputs[0].token_ids == alone
    assert len(both[0].outputs) == 3
    for completion in both[0].outputs:
        validate(json.loads(completion.text), SCHEMAS[1])


def test_speculation_leaves_constrained_requests_alone(model_dir):
    llm = LLM(str(model_dir("llama")), speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for completion in generate(llm, Constraint(json=SCHEMAS[0])):
        validate(json.loads(completion.text), SCHEMAS[0])


@pytest.mark.parametrize("constraint, match", [
    (dict(regex="(unclosed"), "does not compile"),
    (dict(json={"type": "nonsense"}), "structured_outputs"),
    (dict(grammar="start: undefined_rule"), "does not compile"),
])
def test_bad_constraints_are_clear_errors(llm, constraint, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=Constraint(**constraint)), use_tqdm=False)
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        Constraint(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        Constraint()
