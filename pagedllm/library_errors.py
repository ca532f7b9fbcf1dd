"""What an error of a native library (the Rust tokenizers and llguidance, jinja) may tell a client.

Why: their messages can be long and carry internals — llguidance's panic on a 100,000-entry
guided_choice came back as a 35-frame backtrace with the interpreter's source paths — and a 400's
message is for the caller. The first lines up to any backtrace, at most MAX_CHARS characters.
"""
from __future__ import annotations

import re

MAX_CHARS = 300
_BACKTRACE = re.compile(r"<backtrace>|stack backtrace:|\n\s*0: |Traceback \(most recent call last\)")


def concise(message: str) -> str:
    """`message` cut before any backtrace, whitespace folded, at most MAX_CHARS characters."""
    cut = _BACKTRACE.search(message)
    text = " ".join((message[: cut.start()] if cut else message).split())
    text = text.removeprefix("panic: ")
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def describe(exc: BaseException) -> str:
    """An exception as `concise` text, naming its type where the message alone says little."""
    message = concise(str(exc))
    return message or type(exc).__name__
