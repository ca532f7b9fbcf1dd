"""Fields of OpenAI's and vLLM's request bodies that mean nothing here, and the deprecated
spellings clients still send.

Clients written for OpenAI or vLLM send what their API accepts: guidellm asks every stream for
vLLM's `continuous_usage_stats`, LangChain and the openai SDK pass `store`, `metadata` or
`service_tier` through, SDKs older than tools send `functions`. Refusing those with a 400 makes a
client fail where its request is fine, so every field of either API is accepted, and a field of
neither is logged and ignored as vLLM does ("The following fields were present in the request but
ignored"), so a client's own extension does not fail the request. Where a field cannot mean anything here —
there is one tier of service, nothing is stored, the served models do not reason — it is accepted,
ignored, and named once in the log (a warning, as vLLM logs the fields it ignores). Where ignoring it would silently give a wrong answer (audio
output, a web search, code to run as a logits processor) it is a 400 naming it.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("pagedllm.server")

# field -> why it has no effect here
IGNORED = {
    "store": "responses are not stored",
    "metadata": "responses are not stored",
    "service_tier": "there is one tier of service",
    "prompt_cache_key": "the prefix cache finds shared prompts by their tokens",
    "safety_identifier": "no usage policy is enforced per end user",
    "reasoning_effort": "the served models do not reason",
    "verbosity": "the served models have no verbosity control",
    "prediction": "a predicted output only speeds up OpenAI's models; the answer is the same without it",
    "include_obfuscation": "streams are not obfuscated",
    "guided_decoding_backend": "structured output always uses llguidance",
    "guided_whitespace_pattern": "llguidance's JSON whitespace rules apply",
    "cache_salt": "the prefix cache is shared by every request of the server",
    "kv_transfer_params": "no KV transfer between servers",
    "vllm_xargs": "no extension arguments are read",
    "mm_processor_kwargs": "the served models take text only",
    "spaces_between_special_tokens": ("the tokenizers are fast tokenizers, whose decoding has no such option (vLLM's "
                                      "fast detokenizer ignores it too)"),
}
# field -> why it is refused when set (ignoring it would give a wrong answer)
REFUSED = {
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "logits_processors": "this server runs no code a caller supplies",
}

_noted: set[str] = set()


def unsupported(values: dict[str, Any]) -> str | None:
    """The first refused field a request sets, with the reason, as a validator's message."""
    for name, reason in REFUSED.items():
        if values.get(name) not in (None, []):  # {} asks for web search with its defaults
            return f"{name}: {reason}"
    modalities = values.get("modalities")
    if modalities is not None and any(m != "text" for m in modalities):
        return "modalities: only text output is supported"
    return None


def note_ignored(values: dict[str, Any]) -> list[str]:
    """Log, once per field and process, that a set field has no effect; the names set."""
    names = [name for name in IGNORED if values.get(name) is not None]
    for name in names:
        if name not in _noted:
            _noted.add(name)
            logger.warning("request field %r accepted and ignored: %s", name, IGNORED[name])
    return names


MAX_NAMED = 8  # unknown fields named per log line, each cut to 64 characters: the log stays bounded


def note_unknown(extra: dict[str, Any] | None) -> list[str]:
    """Log a request's unknown top-level fields (every request, as vLLM); their names."""
    names = sorted(extra or {})
    if names:
        shown = [name[:64] for name in names[:MAX_NAMED]] + ([f"... {len(names) - MAX_NAMED} more"] if len(names) > MAX_NAMED else [])
        logger.warning("the following fields were present in the request but ignored: %s", shown)
    return names


def tools_from_functions(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's deprecated `functions` as `tools`."""
    return [{"type": "function", "function": function} for function in functions]


def tool_choice_from_function_call(function_call: Any) -> Any:
    """OpenAI's deprecated `function_call` ("none", "auto" or {"name": ...}) as `tool_choice`."""
    if isinstance(function_call, dict):
        return {"type": "function", "function": {"name": function_call.get("name")}}
    return function_call
