"""What every tool-call format shares: the parsed call, the parser interface, and the buffering
of formats whose calls are the whole answer (everything but Hermes' tagged calls)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`


def arguments_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def compact(value: Any) -> str:
    """JSON as the forced grammars write it (no optional whitespace), for replayed calls."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def call_schemas(tools: list[dict[str, Any]], arguments_key: str) -> list[dict[str, Any]]:
    """One JSON schema per tool: {"name": <its name>, arguments_key: <its parameters>}, exactly."""
    return [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]},
                       arguments_key: t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", arguments_key], "additionalProperties": False,
    } for t in tools]


def json_rule(schemas: list[dict[str, Any]]) -> str:
    """A lark rule body matching compact JSON (no runs of spaces) of one of the schemas."""
    return "%json " + json.dumps({"anyOf": schemas, "x-guidance": {"whitespace_flexible": False}})


class ToolParser:
    """One answer's parser (streams keep one per choice). Subclasses set the class attributes
    and implement `feed`, `finish`, `grammar` and `render_calls`."""

    name: ClassVar[str]
    instructions: ClassVar[str]  # the call format, as the fallback prompt shows it to the model

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """The content this delta releases, and the calls it completes."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the answer: the text still held back, and the calls it held."""
        raise NotImplementedError

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], several: bool) -> str:
        """A lark grammar (llguidance) of one call of one of `tools` (OpenAI tool dicts), or of
        one or more when `several`."""
        raise NotImplementedError

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        """Earlier calls ({"name", "arguments": object}) as the model would have written them."""
        raise NotImplementedError

    @classmethod
    def extract(cls, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole answer; content None when only calls were written, the
        text unchanged when it has no call."""
        parser = cls()
        content, calls = parser.feed(text)
        rest, more = parser.finish()
        calls += more
        if not calls:
            return text, []
        return ((content + rest).strip() or None), calls


class WholeAnswerParser(ToolParser):
    """Formats whose calls are the whole answer, opened by a marker (`markers`): text that starts
    otherwise streams as content at once; text that starts with a marker is held to the end and
    parsed whole (it stays content if it does not parse)."""

    markers: ClassVar[tuple[str, ...]]

    def __init__(self) -> None:
        self._buffer = ""
        self._calling: bool | None = None  # None: too little text yet to tell

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        if self._calling is False:
            return delta, []
        self._buffer += delta
        head = self._buffer.lstrip()
        if not head or (self._calling is None and any(m.startswith(head) and m != head for m in self.markers)):
            return "", []  # may still become a marker
        if self._calling is None:
            self._calling = any(head.startswith(m) for m in self.markers)
        if self._calling:
            return "", []
        text, self._buffer = self._buffer, ""
        return text, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        text, self._buffer = self._buffer, ""
        if not self._calling:
            return text, []
        calls = self.parse(text.strip())
        return (text, []) if not calls else ("", calls)

    def parse(self, text: str) -> list[ParsedCall] | None:
        """The calls of a whole answer that starts with a marker; None when it is not calls."""
        raise NotImplementedError
