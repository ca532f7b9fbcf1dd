"""A submitted job body, parsed and checked as a tree before the TrainingJob model sees it.

Why: before these checks a body nested 1,000 deep was a 500 (the JSON parser's RecursionError), a
lone surrogate (JSON's "\\ud800") in `file_glob` was stored and then broke every listing of the
jobs (the answer cannot be encoded as UTF-8), and an integer beyond 64 bits went on towards SQLite
and torch. So, in one walk without recursion, each a ConfigError naming where it is:

- nesting: at most MAX_DEPTH levels (a job is three: sections, fields, list items);
- text: every key and string valid Unicode;
- integers: within SQLite's (and torch's seeds') signed 64 bits.

Non-finite floats are refused by the config models themselves (training/config.py), so `pagedllm
train --config` refuses them too.
"""
from __future__ import annotations

import json
import tomllib
from typing import Any

from pagedllm.training.config import ConfigError

MAX_DEPTH = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOML_TYPES = ("application/toml", "text/x-toml", "text/toml")


class BodyError(ValueError):
    """The body is not a JSON object (TOML table) at all; no field to name."""


def parse_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """The submitted job as a dict: TOML when the content type says so (a job file posted as it is,
    read by the same parser as `pagedllm train --config job.toml`), else JSON; checked by `check_tree`."""
    language = "TOML" if content_type.partition(";")[0].strip().lower() in TOML_TYPES else "JSON"
    try:
        text = raw.decode("utf-8")
        body = tomllib.loads(text) if language == "TOML" else json.loads(text)
    except RecursionError:
        raise BodyError(f"the request body is nested too deeply (a job nests at most {MAX_DEPTH} levels)") from None
    except (UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise BodyError(f"the request body is not valid {language}: {exc}") from exc
    if not isinstance(body, dict):
        raise BodyError(f"the request body must be a {'TOML table' if language == 'TOML' else 'JSON object'}")
    check_tree(body)
    return body


def check_tree(body: dict[str, Any]) -> None:
    """ConfigError at the first value nested deeper than MAX_DEPTH, text that is not valid Unicode,
    or an integer beyond 64 bits."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise ConfigError(path, f"is nested too deeply (a job nests at most {MAX_DEPTH} levels)")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(f"{path}.{printable(key)}" if path else printable(key), key)
                    where = f"{path}.{key}" if path else key
                else:
                    where = f"{path}[{key}]"
                stack.append((item, where, depth + 1))
        elif isinstance(value, str):
            _check_text(path, value)
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(path, f"{value} does not fit a signed 64-bit integer ({INT64_MIN} to {INT64_MAX})")


def _check_text(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(printable(path), f"contains a lone surrogate (U+{ord(text[exc.start]):04X}) at position "
                                           f"{exc.start}: text must be valid Unicode") from None


def encodable(text: str) -> bool:
    """Whether `text` is valid Unicode (JSON's \\ud800 escapes can make text that is not)."""
    return text.isascii() or printable(text) == text


def printable(value: Any) -> Any:
    """`value` with every string made encodable: a lone surrogate becomes its escape (\\ud800). For
    what an older version stored before text was checked: shown, never a 500."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value
