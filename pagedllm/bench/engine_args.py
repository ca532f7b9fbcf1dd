"""`--engine-arg NAME=VALUE` of the benchmarks: extra LLM(...) arguments, values read as int,
float, true/false or else a string."""
from __future__ import annotations


def parse_engine_args(items: list[str] | None) -> dict:
    args = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg takes NAME=VALUE, not {item!r}")
        args[key] = _parse_value(value)
    return args


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)
