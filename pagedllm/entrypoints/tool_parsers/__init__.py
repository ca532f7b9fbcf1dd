"""Tool-call parsers: how a model writes its function calls, read back into (name, arguments).

Each module is one of vLLM's `--tool-call-parser` formats. A parser knows four things about its
format, so the rest of the server stays format-blind:
- `feed` / `finish`: split a (streamed) answer into content and the calls it completed;
- `grammar`: the calls as a llguidance grammar, so a forced `tool_choice` ("required" or a named
  function) always yields calls that parse and follow each function's JSON schema;
- `instructions` / `render_calls`: how the tool-aware fallback (tool_prompt.py) teaches a model
  whose own chat template has no tools to write this format, and replays its earlier calls.
"""
from __future__ import annotations

from pagedllm.entrypoints.tool_parsers.base import ParsedCall, ToolParser
from pagedllm.entrypoints.tool_parsers.hermes import HermesParser
from pagedllm.entrypoints.tool_parsers.llama3_json import Llama3JsonParser
from pagedllm.entrypoints.tool_parsers.mistral import MistralParser
from pagedllm.entrypoints.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
DEFAULT_PARSER = "hermes"


def parser_class(name: str) -> type[ToolParser]:
    """The parser of a --tool-call-parser name; ValueError naming the choices otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(PARSERS)}") from None


__all__ = ["DEFAULT_PARSER", "PARSERS", "ParsedCall", "ToolParser", "parser_class"]
