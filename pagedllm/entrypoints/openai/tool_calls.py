"""Tool calling in chat completions: the calls a model writes, parsed into OpenAI's `tool_calls`.

How calls are written is the served model's tool-call parser's business (pagedllm/entrypoints/
tool_parsers: hermes by default, or --tool-call-parser); this module turns its calls into
OpenAI's objects. `tool_choice`:
- "auto": the model decides; whatever it writes as calls is parsed, the rest is content
  (refused when the server runs with --no-enable-auto-tool-choice, as vLLM without the flag);
- "none": tools are shown to the template, nothing is parsed;
- "required" / a named function: the output is constrained by the parser's grammar (the same
  structured output machinery as `response_format`) to calls of the allowed functions whose
  arguments follow each function's JSON schema — so the call always parses.
A stream holds back text that may be (the start of) a call and emits each call as one delta
(id, name and all arguments) once the parser has it whole.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, NamedToolChoice, ToolCall
from pagedllm.entrypoints.tool_parsers import ParsedCall, ToolParser
from pagedllm.entrypoints.tool_parsers.hermes import HermesParser
from pagedllm.http_errors import BadRequestError
from pagedllm.sampling_params import StructuredOutputsParams


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


def tool_constraint(req: ChatCompletionRequest, parser: type[ToolParser] = HermesParser) -> Optional[StructuredOutputsParams]:
    """The grammar of the calls "required" or a named tool_choice allow (None otherwise): one call
    with a named function or when parallel_tool_calls is false, else one or more."""
    named = chosen_function(req)
    if named is None and req.tool_choice != "required":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools or [] if named is None or t.function.name == named]
    several = named is None and req.parallel_tool_calls is not False
    return StructuredOutputsParams(grammar=parser.grammar(tools, several))


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))


def extract_tool_calls(text: str, parser: type[ToolParser] = HermesParser) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) of a whole answer; content None when only calls were written."""
    content, calls = parser.extract(text)
    return content, [_tool_call(call) for call in calls]


@dataclass
class ToolCallStream:
    """One streamed choice: its parser's content and calls, the calls as OpenAI's (with ids)."""

    parser: ToolParser = field(default_factory=HermesParser)
    calls: int = 0  # emitted so far (the next call's index)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        return self._wrap(*self.parser.feed(delta))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._wrap(*self.parser.finish())

    def _wrap(self, content: str, calls: list[ParsedCall]) -> tuple[str, list[ToolCall]]:
        self.calls += len(calls)
        return content, [_tool_call(call) for call in calls]


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
