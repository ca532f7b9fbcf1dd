"""Hermes (NousResearch; Qwen2.5/3, and the fallback's default): calls between tags, anywhere
in the answer, possibly several in a row —
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
A stream holds back text that may be the start of a tag, and emits each call once its closing
tag arrives; a tagged body that is not a call stays content."""
from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.tool_parsers.base import ParsedCall, ToolParser, arguments_text, compact, call_schemas, json_rule

START, END = "<tool_call>", "</tool_call>"


def call_from_json(body: str) -> ParsedCall | None:
    """A call from JSON text {"name", "arguments" (or "parameters")}; None when it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ParsedCall(value["name"], arguments_text(arguments))


class HermesParser(ToolParser):
    name = "hermes"
    instructions = f'{START}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{END}'

    def __init__(self) -> None:
        self._buffer = ""  # text that may still be (the start of) a call

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += delta
        content, calls = "", []
        while True:
            start = self._buffer.find(START)
            if start < 0:
                keep = partial_suffix(self._buffer, START)
                content += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return content, calls
            end = self._buffer.find(END, start)
            if end < 0:
                content += self._buffer[:start]
                self._buffer = self._buffer[start:]
                return content, calls
            call = call_from_json(self._buffer[start + len(START): end])
            if call is None:
                content += self._buffer[: end + len(END)]
            else:
                content += self._buffer[:start]
                calls.append(call)
            self._buffer = self._buffer[end + len(END):]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self._buffer = self._buffer, ""  # an unclosed call stays text
        return rest, []

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], several: bool) -> str:
        repeat = ' ("\\n" call)*' if several else ""
        return (f'start: call{repeat}\ncall: "{START}\\n" body "\\n{END}"\n'
                f'body: {json_rule(call_schemas(tools, "arguments"))}')

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{START}\n{compact({'name': c['name'], 'arguments': c['arguments']})}\n{END}"
                         for c in calls)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
