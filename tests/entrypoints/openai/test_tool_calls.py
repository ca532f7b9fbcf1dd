"""Tool calls as OpenAI's objects (tool_calls.py, over the default Hermes parser): whole answers and
the same answers streamed in every split, calls between text, calls that are not JSON left as
text, a held-back partial tag, ids unique and numbered deltas. The formats themselves:
tests/entrypoints/tool_parsers."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import ToolCallStream, extract_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def calls(found) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in found]


@pytest.mark.parametrize("text, content, expected", [
    (CALL, None, [("get_weather", {"city": "Paris", "unit": "C"})]),
    (TWO, None, [("get_weather", {"city": "Paris", "unit": "C"}), ("now", {})]),
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "Paris", "unit": "C"})]),
    ("no calls <tool_ here", "no calls <tool_ here", []),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("<tool_call>\n{\"name\": \"cut", "<tool_call>\n{\"name\": \"cut", []),
])
def test_whole_answers(text, content, expected):
    found_content, found = extract_tool_calls(text)
    assert found_content == content and calls(found) == expected
    assert len({c.id for c in found}) == len(found) and all(c.id.startswith("call_") for c in found)


@pytest.mark.parametrize("text", ["Sure: " + TWO, "a <tool_ b " + CALL + " tail", "<tool_call>\n{bad}\n</tool_call>"])
def test_streaming_equals_whole_for_every_split(text):
    whole_content, whole_calls = extract_tool_calls(text)
    for size in (1, 2, 3, 7, len(text)):
        parser, content, found = ToolCallStream(), "", []
        for start in range(0, len(text), size):
            piece, new = parser.feed(text[start:start + size])
            assert "<tool_call>" not in piece or not whole_calls  # a call's text never leaks as content
            content += piece
            found += new
        rest, more = parser.finish()
        content, found = content + rest, found + more
        assert parser.calls == len(found)
        assert calls(found) == calls(whole_calls)
        assert (content.strip() or None) == whole_content if whole_calls else content == text
