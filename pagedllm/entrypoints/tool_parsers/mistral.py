"""mistral (Mistral 7B v0.3, Nemo, Small): `[TOOL_CALLS]` then a JSON array of
`{"name": ..., "arguments": {...}}`. In Mistral's tokenizers `[TOOL_CALLS]` is a special token:
serve such a model with `skip_special_tokens: false` requests (vLLM's parser sets it) or the marker
vanishes from the text; a bare array is read as calls too. Calls are emitted when the answer ends."""
from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.tool_parsers.base import ParsedCall, WholeAnswerParser, call_schemas, compact, json_rule
from pagedllm.entrypoints.tool_parsers.hermes import call_from_json

MARKER = "[TOOL_CALLS]"


class MistralParser(WholeAnswerParser):
    name = "mistral"
    markers = (MARKER, "[{")
    instructions = f'{MARKER}[{{"name": <function name>, "arguments": <arguments as a JSON object>}}, ...]'

    def parse(self, text: str) -> list[ParsedCall] | None:
        try:
            value = json.loads(text.removeprefix(MARKER).strip())
        except json.JSONDecodeError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(json.dumps(item)) for item in items]
        return calls if calls and all(calls) else None

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], several: bool) -> str:
        repeat = ' ("," call)*' if several else ""
        return f'start: "{MARKER}[" call{repeat} "]"\ncall: {json_rule(call_schemas(tools, "arguments"))}'

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        return MARKER + compact([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
