"""pythonic (Llama 3.2 / 4's and ToolACE's): the answer is a Python list of calls with keyword
arguments, `[get_weather(city="Paris", unit="C"), now(tz=1)]`. Argument values are literals;
JSON's true / false / null are read as Python's True / False / None (the forced grammar writes
each value as JSON, following its schema). Calls are emitted when the answer ends."""
from __future__ import annotations

import ast
import json
from typing import Any

from pagedllm.entrypoints.tool_parsers.base import ParsedCall, WholeAnswerParser, arguments_text, compact

_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def _call(node: ast.expr) -> ParsedCall:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        raise ValueError("not a call by keyword arguments")
    arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    return ParsedCall(node.func.id, arguments_text(arguments))


class PythonicParser(WholeAnswerParser):
    name = "pythonic"
    markers = ("[",)
    instructions = '[function_name(argument=value, ...), ...]  (a Python list of calls, values as Python literals)'

    def parse(self, text: str) -> list[ParsedCall] | None:
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            return [_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return None

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], several: bool) -> str:
        """Each call names a tool and passes its required arguments, in the schema's order, each
        value JSON following its property's schema (optional arguments are left out)."""
        rules, calls = [], []
        for i, tool in enumerate(tools):
            function = tool["function"]
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties") or {}
            items = []
            for j, key in enumerate(parameters.get("required") or []):
                schema = {**properties.get(key, {}), "x-guidance": {"whitespace_flexible": False}}
                rules.append(f"value_{i}_{j}: %json {json.dumps(schema)}")
                items.append(f'{json.dumps((", " if j else "") + key + "=")} value_{i}_{j}')
            rules.append(f'call_{i}: {json.dumps(function["name"] + "(")} {" ".join(items)} ")"')
            calls.append(f"call_{i}")
        repeat = ' (", " call)*' if several else ""
        return "\n".join([f'start: "[" call{repeat} "]"', f"call: {' | '.join(calls)}", *rules])

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        rendered = [f"{c['name']}({', '.join(f'{k}={compact(v)}' for k, v in (c['arguments'] or {}).items())})" for c in calls]
        return "[" + ", ".join(rendered) + "]"
