"""llama3_json (Llama 3.1/3.2's JSON tool calling): the answer is one or more JSON objects
`{"name": ..., "parameters": {...}}` separated by "; ", optionally after `<|python_tag|>`.
As vLLM's parser, "arguments" is read too. Calls are emitted when the answer ends."""
from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.tool_parsers.base import ParsedCall, WholeAnswerParser, call_schemas, compact, json_rule
from pagedllm.entrypoints.tool_parsers.hermes import call_from_json

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "


class Llama3JsonParser(WholeAnswerParser):
    name = "llama3_json"
    markers = (PYTHON_TAG, "{")
    instructions = ('{"name": <function name>, "parameters": <arguments as a JSON object>}  '
                    f'(several calls separated by "{SEPARATOR}")')

    def parse(self, text: str) -> list[ParsedCall] | None:
        text = text.removeprefix(PYTHON_TAG).strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                value, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            call = call_from_json(json.dumps(value))
            if call is None:
                return None
            calls.append(call)
            at = end
            while at < len(text) and text[at] in "; \n":
                at += 1
        return calls or None

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], several: bool) -> str:
        repeat = f' ("{SEPARATOR}" call)*' if several else ""
        return f'start: call{repeat}\ncall: {json_rule(call_schemas(tools, "parameters"))}'

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        return SEPARATOR.join(compact({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
