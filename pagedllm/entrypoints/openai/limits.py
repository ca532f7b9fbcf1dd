"""How much one request may ask for, checked before any work is done for it.

Why: the server's event loop, its tokenizer and each model's engine thread are shared by every
client. Before these limits a 50 MB prompt was tokenized on the event loop (156 s, RSS 3.5 ->
15.6 GB, /health silent) before its length was checked, and a 100,000-entry guided_choice held
the engine thread for 40 s compiling a grammar. Now:

- the body: at most `max_body_bytes` (`pagedllm serve --max-body-bytes`, default 4 MiB), refused
  with 413 from its Content-Length before it is read (or as soon as a chunked body passes it);
- its fields: list and string sizes in `protocol.py` (prompts per request, stop strings, messages
  and content parts, guided_choice entries, grammar and schema sizes, names), each a 400 naming the
  field; numeric ranges in SamplingParams;
- a prompt's characters: a text longer than `prompt_char_limit()` cannot fit the context whatever
  it tokenizes to, so it is refused before the tokenizer sees it; what passes is tokenized on the
  model's tokenizer thread, never on the event loop (serving.py), and a long one first by its
  head (`probe_prefix`): if that alone is over the context, the rest is never tokenized;
- text must be valid Unicode: a lone surrogate (JSON's "\\ud800") is a 400 naming the field, not a
  tokenizer's TypeError.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_PROMPTS = 256  # prompts in one completions request (each is an engine request of n samples)
MAX_STOP = 16  # stop strings (OpenAI allows 4)
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids: more than any vocabulary served here
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256  # per message
MAX_TOOLS = 128
MAX_CHOICES = 1024  # guided_choice entries: compiled in ~40 ms; 100,000 took 40 s and a panic
MAX_CHOICE_CHARS = 1000
MAX_GRAMMAR_CHARS = 64 * 1024  # regex, grammar, and a JSON schema as JSON text
MAX_NAME_CHARS = 256  # model, user, message and tool names, ids
MAX_PRIORITY = 2**31 - 1
# logprob entries one response may carry (serving.check_logprob_volume): ~50 bytes each as JSON
MAX_LOGPROB_ENTRIES = 1 << 22
# A token of the vocabulary covers at most its longest entry's characters; twice that per token of
# context is the most a prompt can have and still fit (the factor leaves room for normalizers that
# fold several characters into one).
CHARS_PER_TOKEN_FACTOR = 2
# Text longer than twice this many characters per token of context is tokenized by its head first
# (probe_prefix): code and prose take 3-4 characters a token, so the head of a text far over the
# context is over it too, for a few milliseconds of tokenizing instead of a second.
PROBE_CHARS_PER_TOKEN = 4
PROBE_MARGIN = 16


def valid_unicode(value: str) -> str:
    """`value`, if it is valid Unicode (no lone surrogate, which JSON's \\ud800 escapes can make)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate (U+{ord(value[exc.start]):04X}) at position {exc.start}: "
                         "text must be valid Unicode") from None
    return value


def json_size(limit: int):
    """A validator: a JSON value (a schema, tool parameters) whose text is at most `limit` characters
    and valid Unicode."""
    def check(value: Any) -> Any:
        if value is None:
            return value
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if len(text) > limit:
            raise ValueError(f"is {len(text)} characters as JSON, more than the {limit} allowed")
        valid_unicode(text)
        return value

    return check


Text = Annotated[str, AfterValidator(valid_unicode)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(valid_unicode)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]
Choice = Annotated[str, Field(max_length=MAX_CHOICE_CHARS), AfterValidator(valid_unicode)]
Grammar = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS), AfterValidator(valid_unicode)]
JsonSchema = AfterValidator(json_size(MAX_GRAMMAR_CHARS))  # metadata for Annotated[<a JSON type>, JsonSchema]


def probe_prefix(text: str, max_model_len: int) -> str | None:
    """The head of a long text to tokenize first: about PROBE_CHARS_PER_TOKEN characters per token
    of context, cut at its last whitespace (where pre-tokenizers split anyway); None when the text
    is short enough to tokenize whole. A head of more than max_model_len + PROBE_MARGIN tokens
    means the whole text is over the context: it holds the head, and the cut can only have split
    one word into a few more tokens than the whole text gives it."""
    size = max_model_len * PROBE_CHARS_PER_TOKEN
    if len(text) <= 2 * size:
        return None
    cut = max(text.rfind(" ", 0, size), text.rfind("\n", 0, size))
    return text[: cut if cut > size // 2 else size]


def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry, in characters (byte-level entries count each byte as one,
    so this bounds the characters any one token covers)."""
    return max((len(entry) for entry in tokenizer.get_vocab()), default=1)


def prompt_char_limit(max_model_len: int, token_chars: int) -> int:
    """The most characters a prompt may have and still fit max_model_len tokens."""
    return max_model_len * max(token_chars, 1) * CHARS_PER_TOKEN_FACTOR


class BodyLimitMiddleware:
    """413 in OpenAI's error shape for a request body over `max_bytes`: from its Content-Length
    before anything is read; a chunked body (no length) is read up to the limit first and refused
    as soon as it passes it, then handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(send, int(length))
                return
            await self.app(scope, receive, send)
            return
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                await self._refuse(send, received)
                return
            if not message.get("more_body"):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send, size: int) -> None:
        body = json.dumps(error_body(
            f"the request body has {size} bytes or more, more than the {self.max_bytes} this server accepts "
            "(pagedllm serve --max-body-bytes)", "invalid_request_error", None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then what the client sends (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
