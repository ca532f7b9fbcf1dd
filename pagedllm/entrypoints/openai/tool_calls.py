"""Tool calling in chat completions: the calls a model writes, parsed into OpenAI's `tool_calls`.

The models speak Hermes-style calls (what the chat template teaches them when `tools` are given):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, possibly several in a row.
`tool_choice`:
- "auto": the model decides; whatever it writes as calls is parsed, the rest is content.
- "none": tools are shown to the template, nothing is parsed.
- "required" / a named function: the output is constrained by a grammar (the same structured
  output machinery as `response_format`) to calls of the allowed functions whose arguments
  follow each function's JSON schema — so the call always parses.
A parser that streams holds back text that may be the start of a call, and emits each call as
one delta (id, name and all arguments) once its closing tag arrives.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, NamedToolChoice, ToolCall
from pagedllm.http_errors import BadRequestError
from pagedllm.sampling_params import StructuredOutputsParams

START, END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def chosen_function(req: ChatCompletionRequest) -> Optional[str]:
    """The function a named tool_choice forces, checked against the request's tools."""
    choice = req.tool_choice
    if not isinstance(choice, NamedToolChoice):
        return None
    name = choice.function.name
    if name not in {tool.function.name for tool in req.tools or []}:
        raise BadRequestError(f"tool_choice names function {name!r}, which is not among the request's tools", "tool_choice")
    return name


def parses_calls(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def tool_constraint(req: ChatCompletionRequest) -> Optional[StructuredOutputsParams]:
    """The grammar of the calls "required" or a named tool_choice allow (None otherwise): one call
    with a named function or when parallel_tool_calls is false, else one or more."""
    named = chosen_function(req)
    if named is None and req.tool_choice != "required":
        return None
    tools = [t for t in req.tools or [] if named is None or t.function.name == named]
    schema = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False,
    } for t in tools], "x-guidance": {"whitespace_flexible": False}}  # compact JSON: no runs of spaces
    repeat = "" if named is not None or req.parallel_tool_calls is False else ' ("\\n" call)*'
    grammar = f'start: call{repeat}\ncall: "{START}\\n" body "\\n{END}"\nbody: %json {json.dumps(schema)}'
    return StructuredOutputsParams(grammar=grammar)


def _call(body: str) -> Optional[ToolCall]:
    """A call from the JSON between the tags; None when it is not one (left as content)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(id=new_call_id(), function=FunctionCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False)))


def extract_tool_calls(text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) of a whole answer; content None when only calls were written."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    content += parser.finish()
    if not calls:
        return text, []
    return (content.strip() or None), calls


@dataclass
class ToolCallParser:
    """Splits streamed text into content and complete calls."""

    _buffer: str = ""  # text that may still be (the start of) a call
    _calls: int = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buffer += delta
        content, calls = "", []
        while True:
            start = self._buffer.find(START)
            if start < 0:
                keep = _partial_suffix(self._buffer, START)
                content += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return content, calls
            end = self._buffer.find(END, start)
            if end < 0:
                content += self._buffer[:start]
                self._buffer = self._buffer[start:]
                return content, calls
            call = _call(self._buffer[start + len(START): end])
            if call is None:
                content += self._buffer[: end + len(END)]
            else:
                content += self._buffer[:start]
                calls.append(call)
                self._calls += 1
            self._buffer = self._buffer[end + len(END):]

    def finish(self) -> str:
        """What is left when the answer ends: an unclosed call stays text."""
        rest, self._buffer = self._buffer, ""
        return rest

    @property
    def calls(self) -> int:
        return self._calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def template_tools(req: ChatCompletionRequest) -> Optional[list[dict[str, Any]]]:
    return [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: earlier calls' arguments as objects (templates
    write them with `tojson`), a tool result with the id of the call it answers."""
    item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.name is not None:
        item["name"] = message.name
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        item["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                              for c in message.tool_calls]
    return item


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
