"""The four tool-call formats on sample outputs (as the models write them, from vLLM's and the
model cards' examples): whole answers, every streamed split equal to the whole answer, text that
is not a call left as content, and each format's forced-choice grammar accepting exactly the
calls it renders (llguidance, on a real byte-level BPE tokenizer)."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.tool_parsers import PARSERS, parser_class
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.manager import StructuredOutputManager
from tiny_models import build_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
PARIS = ("get_weather", {"city": "Paris", "unit": "C"})

# parser -> [(model output, expected content, expected calls)]
SAMPLES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>', None, [PARIS]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
         '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Let me check.", [PARIS, ("now", {})]),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
        ('<tool_call>\n{"name": "cut', '<tool_call>\n{"name": "cut', []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; {"name": "now", "parameters": {}}',
         None, [PARIS, ("now", {})]),
        ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}', None, [PARIS]),  # vLLM reads "arguments" too
        ("The weather is fine.", "The weather is fine.", []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]', None, [PARIS]),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, {"name": "now", "arguments": {}}]',
         None, [PARIS, ("now", {})]),
        ("[1, 2] are numbers", "[1, 2] are numbers", []),
        ("Paris is sunny.", "Paris is sunny.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="C")]', None, [PARIS]),
        ("[get_weather(city='Paris', unit='C'), now()]", None, [PARIS, ("now", {})]),
        ('[search(query="x", exact=true, limit=None, tags=["a"])]', None,
         [("search", {"query": "x", "exact": True, "limit": None, "tags": ["a"]})]),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("Paris is sunny.", "Paris is sunny.", []),
        ('[get_weather(city="Par', '[get_weather(city="Par', []),
    ],
}
CASES = [(name, *case) for name, cases in SAMPLES.items() for case in cases]


def as_pairs(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_every_vllm_parser_is_registered():
    assert set(PARSERS) == set(SAMPLES) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="hermes"):
        parser_class("nope")


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_whole_answers(name, text, content, expected):
    found_content, found = parser_class(name).extract(text)
    assert (found_content, as_pairs(found)) == (content, expected)


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_streaming_equals_whole_for_every_split(name, text, content, expected):
    for size in (1, 2, 5, len(text)):
        parser, streamed, found = parser_class(name)(), "", []
        for start in range(0, len(text), size):
            piece, calls = parser.feed(text[start:start + size])
            streamed, found = streamed + piece, found + calls
        rest, calls = parser.finish()
        streamed, found = streamed + rest, found + calls
        assert as_pairs(found) == expected
        assert (streamed.strip() or None) == content if expected else streamed == text


def test_content_streams_before_the_answer_ends():
    """A whole-answer format releases plain text at once; only a possible call is held."""
    for name in ("llama3_json", "mistral", "pythonic"):
        assert parser_class(name)().feed("Hello")[0] == "Hello"
        assert parser_class(name)().feed(" ")[0] == ""  # too little to tell


@pytest.fixture(scope="module")
def structured(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("tok"))
    return tokenizer, StructuredOutputManager(tokenizer, len(tokenizer))


def accepts(structured, grammar: str, text: str) -> bool:
    tokenizer, manager = structured
    matcher = manager.matcher(StructuredOutputsParams(grammar=grammar))
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_grammar_accepts_the_calls_it_renders_and_nothing_else(structured, name):
    parser = parser_class(name)
    one = parser.render_calls([{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}])
    two = parser.render_calls([{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
                               {"name": "now", "arguments": {}}])
    single, several = parser.grammar([WEATHER, NOW], several=False), parser.grammar([WEATHER, NOW], several=True)
    assert accepts(structured, single, one) and accepts(structured, several, one) and accepts(structured, several, two)
    assert not accepts(structured, single, two)  # parallel_tool_calls false: one call
    wrong_enum = parser.render_calls([{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}])
    unknown = parser.render_calls([{"name": "get_time", "arguments": {}}])
    assert not accepts(structured, several, wrong_enum) and not accepts(structured, several, unknown)
    assert as_pairs(parser.extract(two)[1]) == [PARIS, ("now", {})]  # what the grammar allows parses
