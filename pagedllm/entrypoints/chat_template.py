"""A conversation through a model's chat template: what the server's chat endpoint and
`LLM.chat` both render, with transformers' `apply_chat_template` (vLLM's options)."""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.deadline import DeadlineExceeded, call_with_deadline
from pagedllm.entrypoints.tool_parsers import ToolParser
from pagedllm.entrypoints.tool_parsers.hermes import HermesParser
from pagedllm.entrypoints.tool_prompt import fallback_messages, needs_fallback
from pagedllm.library_errors import describe

# A real template renders a conversation in milliseconds; a loop that runs for seconds is broken or
# hostile, and holds the model's tokenizer thread while it runs (deadline.py).
RENDER_SECONDS = 5.0
# The rendered prompt: far more than any context holds (the prompt-length checks come after), small
# enough that a template multiplying its input cannot fill memory.
MAX_RENDERED_CHARS = 1 << 24

# apply_chat_template's own arguments: a template variable of the same name would change what it
# returns, not what the template sees
_RESERVED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatTemplateError(ValueError):
    """The template cannot render these messages (or the model has none); the message says why."""


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                chat_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, documents: list[dict[str, str]] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None,
                tool_parser: type[ToolParser] = HermesParser) -> str:
    """The prompt text; the template places BOS itself, so it is tokenized without special tokens.
    `chat_template` (Jinja text) replaces the model's own. A template that knows no tools gets the
    tool-aware fallback (tool_prompt.py), teaching `tool_parser`'s call format."""
    if chat_template is None and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError("the model has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)")
    if needs_fallback(chat_template or tokenizer.chat_template, messages, tools):
        messages, tools = fallback_messages(messages, tools, tool_parser), None
    extra = dict(chat_template_kwargs or {})
    clashing = sorted(_RESERVED & extra.keys())
    if clashing:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clashing}: they are the renderer's own arguments")
    try:
        text = call_with_deadline(
            RENDER_SECONDS, tokenizer.apply_chat_template, messages, tools=tools, documents=documents,
            chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **extra)
    except DeadlineExceeded as exc:
        raise ChatTemplateError(f"the chat template {exc} rendering these messages") from None
    except Exception as exc:  # jinja2 errors, e.g. a template that enforces role alternation
        raise ChatTemplateError(f"the chat template rejected the messages: {describe(exc)}") from exc
    if len(text) > MAX_RENDERED_CHARS:
        raise ChatTemplateError(f"the chat template rendered {len(text)} characters, more than {MAX_RENDERED_CHARS}")
    return text


def load_chat_template(value: str) -> str:
    """--chat-template's value as vLLM reads it: a file's text, or the Jinja text itself; its
    syntax is checked here (in the sandbox transformers renders with), so a typo fails at start-up."""
    from pathlib import Path

    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor Jinja text")
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: line {exc.lineno}: {exc.message}") from None
    return text
