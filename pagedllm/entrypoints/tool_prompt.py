"""The tool-aware fallback: tools for a model whose chat template knows none (SmolLM2's, and
most small models'), by rewriting the conversation instead of the template.

The model's own template still renders the result, so its role markers and special tokens stay
what the model was trained on; only three things change:
- the tools, as JSON schemas, and the call format of the server's tool-call parser (Hermes
  unless --tool-call-parser says otherwise) are appended to the system message (one is added
  first when the conversation has none);
- an assistant's earlier calls become its text, written in that format;
- tool results become user messages, `<tool_response>\\n...\\n</tool_response>` (consecutive
  results in one message), as Qwen2.5's and Hermes' templates render them.
A template counts as tool-aware when it mentions `tools` (as transformers' tool templates all do).
With tool_choice "required" or a named function the call is guided by the parser's grammar, so
even a model never trained on tools answers with calls that parse.
"""
from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.tool_parsers import ToolParser

RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"


def knows_tools(template: str) -> bool:
    return "tools" in template


def needs_fallback(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether the conversation uses tools (offered now, or called earlier) the template cannot render."""
    uses_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    return uses_tools and not knows_tools(template)


def tools_prompt(tools: list[dict[str, Any]], parser: type[ToolParser]) -> str:
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query. The functions, as JSON "
            f"schemas:\n<tools>\n{schemas}\n</tools>\n\nTo call a function, answer with nothing but:\n"
            f"{parser.instructions}\nA function's result comes back as {RESPONSE_START}...{RESPONSE_END}.")


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      parser: type[ToolParser]) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results written as plain messages (see the module)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "tool":
            result = f"{RESPONSE_START}\n{message.get('content') or ''}\n{RESPONSE_END}"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
        elif message.get("tool_calls"):
            calls = parser.render_calls([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                         for c in message["tool_calls"]])
            text = message.get("content") or ""
            out.append({"role": message["role"], "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append(dict(message))
    for message in out:
        message.pop("_results", None)
    if tools:
        prompt = tools_prompt(tools, parser)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
