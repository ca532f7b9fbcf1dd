"""What completions and chat share: request → SamplingParams, submission with error mapping,
waiting for the final outputs, SSE framing, token strings and usage.

The translation is deliberately thin: SamplingParams validates the values, the engine validates
prompts (and names max_model_len), and this layer only maps their errors to OpenAI's shapes.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.entrypoints.openai import compat
from pagedllm.entrypoints.openai.async_engine import (
    Disconnected,
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
    RequestGroup,
    RequestTimeout,
)
from pagedllm.entrypoints.openai.errors import param_from_message
from pagedllm.entrypoints.openai.limits import MAX_LOGPROB_ENTRIES, PROBE_MARGIN, probe_prefix, valid_unicode
from pagedllm.entrypoints.openai.models import ServedModel
from pagedllm.entrypoints.openai.protocol import SamplingFields, UsageInfo
from pagedllm.entrypoints.openai.replicas import ReplicaDiedError
from pagedllm.http_errors import (
    APIError,
    BadRequestError,
    ModelNotFoundError,
    RequestTimeoutError,
    ServiceUnavailableError,
    error_body,
)
from pagedllm.library_errors import describe
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
# A full waiting queue drains as requests finish; one second is the usual back-off for a client to retry.
QUEUE_FULL_RETRY_AFTER_S = 1


@dataclass
class EnginePrompt:
    text: str  # what echo returns ("" when the model has no tokenizer)
    token_ids: list[int]

    def to_engine(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def new_id(prefix: str, request_id: str | None = None) -> str:
    """A response id; built from the client's `request_id` (vLLM's field) when it gave one."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def accept(req: SamplingFields) -> None:
    """The request's accepted-but-ignored fields and its unknown ones, named in the log (compat.py)."""
    compat.note_ignored(req.__dict__)
    compat.note_unknown(req.model_extra)


def truncate(token_ids: list[int], req: SamplingFields, served: ServedModel) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: max_model_len)."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return token_ids
    keep = served.max_model_len if keep == -1 else keep
    return token_ids[-keep:] if keep else []


def now() -> int:
    return int(time.time())


# ---- request → engine --------------------------------------------------------------------------
def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def structured_outputs(req: SamplingFields, response_format: Any = None) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint, from whichever spelling it used (at most one), and that
    field's name: a constraint that does not compile is reported against it."""
    given: dict[str, dict[str, Any]] = {}
    if req.structured_outputs is not None:
        given["structured_outputs"] = req.structured_outputs.model_dump(exclude_none=True, by_alias=True)
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given[name] = {key: getattr(req, name)}
    if response_format is not None and response_format.type != "text":
        schema = response_format.json_schema.schema_ if response_format.json_schema is not None else None
        given["response_format"] = {"json": schema or {}} if response_format.type == "json_schema" else {"json_object": True}
    if len(given) > 1:
        raise BadRequestError(f"give one output constraint, not {len(given)}: {sorted(given)}", sorted(given)[1])
    if not given:
        return None, None
    (param, constraint), = given.items()
    try:
        return StructuredOutputsParams(**constraint), param
    except (TypeError, ValueError) as exc:
        raise BadRequestError(str(exc), param) from exc


def logit_bias(req: SamplingFields, served: ServedModel) -> dict[int, float] | None:
    """OpenAI's logit_bias: its keys are token ids written as strings; each must be one of the
    model's (the bias range is SamplingParams' check)."""
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        if not re.fullmatch(r"[0-9]+", key):
            raise BadRequestError(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}",
                                  "logit_bias")
        bias[int(key)] = value
    token_ids_in_vocab(bias, served, "logit_bias")
    return bias


def token_ids_in_vocab(ids: Any, served: ServedModel, param: str) -> Any:
    for token in ids or ():
        if token >= served.vocab_size:
            raise BadRequestError(f"{param}: token id {token} is outside the vocabulary [0, {served.vocab_size}) of model "
                                  f"{served.name!r}", param)
    return ids


def sampling_params(req: SamplingFields, served: ServedModel, **fields: Any) -> SamplingParams:
    """SamplingParams from the shared request fields plus endpoint-specific `fields`
    (max_tokens, logprobs, prompt_logprobs, best_of); its ValueError becomes a 400."""
    kwargs = dict(
        n=req.n,
        temperature=_or(req.temperature, 1.0),
        top_p=_or(req.top_p, 1.0),
        top_k=-1 if req.top_k in (None, 0) else req.top_k,  # vLLM: 0 or -1 disables top-k
        min_p=_or(req.min_p, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=logit_bias(req, served),
        allowed_token_ids=token_ids_in_vocab(req.allowed_token_ids, served, "allowed_token_ids"),
        **fields,
    )
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise BadRequestError(str(exc), param_from_message(str(exc), list(kwargs))) from exc
    limit = served.max_num_seqs
    if params.best_of > limit:
        param = "best_of" if params.best_of != params.n else "n"
        raise BadRequestError(f"{param}={params.best_of} exceeds max_num_seqs={limit} of model {served.name!r}", param)
    return params


def check_context_length(prompt_len: int, max_tokens: int | None, served: ServedModel, param: str = "max_tokens") -> None:
    """vLLM's and OpenAI's rule: prompt + requested tokens must fit the context — and the whole KV
    cache, which may hold fewer tokens than max_model_len: a sequence longer than the pool could
    never run. (A prompt that alone is too long is left to the engine, whose message names the limit.)"""
    if max_tokens is None:
        return
    total = prompt_len + max_tokens
    max_model_len, pool = served.max_model_len, served.kv_cache_tokens
    if prompt_len < max_model_len < total:
        raise BadRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but {total} were "
            f"requested ({prompt_len} in the prompt, {max_tokens} for the completion); reduce {param} or the prompt",
            param,
        )
    if prompt_len < pool < total:
        raise BadRequestError(
            f"{total} tokens were requested ({prompt_len} in the prompt, {max_tokens} for the completion), but the "
            f"KV cache of model {served.name!r} holds {pool} tokens in all: the request could never run; reduce {param} "
            "or the prompt",
            param,
        )


def check_logprob_volume(prompt_lens: list[int], params: SamplingParams, served: ServedModel) -> None:
    """Logprobs multiply a response: every sample of every prompt carries `logprobs` + 1 entries for
    each generated token (and, echoed, each prompt token). The product is bounded so that one request
    cannot make the server build and send gigabytes (n=256 x 8,192 tokens x 21 entries is 44 million)."""
    if params.logprobs is None and params.prompt_logprobs is None:
        return
    per_token = (params.logprobs or 0) + 1
    entries = 0
    for prompt_len in prompt_lens:
        generated = params.max_tokens if params.max_tokens is not None else served.max_model_len - prompt_len
        echoed = prompt_len * ((params.prompt_logprobs or 0) + 1) if params.prompt_logprobs is not None else 0
        entries += params.n * generated * per_token + echoed
    if entries > MAX_LOGPROB_ENTRIES:
        raise BadRequestError(
            f"the response would hold {entries} logprob entries (samples x tokens x (logprobs + 1)), more than the "
            f"limit of {MAX_LOGPROB_ENTRIES}; lower logprobs, n or max_tokens", "logprobs")


def check_prompt_chars(served: ServedModel, chars: int, param: str) -> None:
    """A text longer than the model's prompt character limit cannot fit its context, whatever it
    tokenizes to: a 400 before the tokenizer spends time (and memory) on it (limits.py)."""
    limit = served.max_prompt_chars
    if chars > limit:
        raise BadRequestError(
            f"the {param} has {chars} characters, but max_model_len is {served.max_model_len} tokens and no text of more than "
            f"{limit} characters fits them (model {served.name!r}'s longest token has {served.max_token_chars})", param)


async def encode(served: ServedModel, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """`text` as token ids, tokenized on the model's tokenizer thread (never on the event loop),
    after the length check, and for a long text after its head showed it may fit (limits.py);
    a tokenizer's error is a 400 naming `param`."""
    check_prompt_chars(served, len(text), param)
    valid_unicode_or_400(text, param)
    head = probe_prefix(text, served.max_model_len)
    if head is not None:
        counted = len(await _tokenize(served, head, param, add_special_tokens))
        if counted > served.max_model_len + PROBE_MARGIN:
            raise BadRequestError(
                f"the {param} has more than {served.max_model_len} tokens (its first {len(head)} of {len(text)} characters "
                f"alone are {counted}), but max_model_len is {served.max_model_len}", param)
    return await _tokenize(served, text, param, add_special_tokens)


async def _tokenize(served: ServedModel, text: str, param: str, add_special_tokens: bool) -> list[int]:
    try:
        return await served.on_tokenizer_thread(served.tokenizer.encode, text, add_special_tokens=add_special_tokens)
    except Exception as exc:
        raise BadRequestError(f"{param} could not be tokenized: {describe(exc)}", param) from exc


def valid_unicode_or_400(text: str, param: str) -> None:
    """The request models check their strings; text put together from them (a rendered chat
    template) is checked again, so a tokenizer never meets a lone surrogate."""
    try:
        valid_unicode(text)
    except ValueError as exc:
        raise BadRequestError(f"{param} {exc}", param) from None


_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def api_error(exc: Exception, prompt_param: str, constraint_param: str | None = None) -> APIError:
    """The engine side's exceptions in OpenAI's terms."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return ServiceUnavailableError(str(exc), code="queue_full", headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})
    if isinstance(exc, RequestTimeout):
        return RequestTimeoutError(str(exc))
    if isinstance(exc, EngineStoppedError):
        return ModelNotFoundError(str(exc))
    if isinstance(exc, ReplicaDiedError):
        return ServiceUnavailableError(str(exc), code="replica_died", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(str(exc), code="engine_dead")
    if isinstance(exc, ValueError):
        message = str(exc)
        if constraint_param is not None and message.startswith("structured_outputs:"):
            return BadRequestError(message, constraint_param)
        return BadRequestError(message, prompt_param if "prompt" in message else param_from_message(message, _PARAMS))
    raise exc


@asynccontextmanager
async def submitted(
    served: ServedModel, request_id: str, prompts: list[EnginePrompt], params: SamplingParams,
    priority: int, prompt_param: str, constraint_param: str | None = None,
) -> AsyncIterator[RequestGroup]:
    """`AsyncEngine.submit` with one request per prompt, its rejections as APIErrors."""
    engine_prompts = [(f"{request_id}-{i}", p.to_engine()) for i, p in enumerate(prompts)]
    entered = False
    try:
        submit = served.engine.submit(engine_prompts, params, arrival_time=time.time(), priority=priority,
                                      **({"lora_request": served.lora_request} if served.lora_request else {}))
        async with submit as group:
            entered = True
            yield group
    except Exception as exc:
        if entered:
            raise
        raise api_error(exc, prompt_param, constraint_param) from exc


async def final_outputs(group: RequestGroup, raw: Request, prompt_param: str) -> list[RequestOutput]:
    """Wait until every request of `group` finished; in prompt order. Aborts if the client leaves."""
    try:
        async for _ in group.updates(raw.is_disconnected):
            pass
    except (EngineDeadError, EngineStoppedError, RequestTimeout) as exc:
        raise api_error(exc, prompt_param) from exc
    return [group.outputs[request_id] for request_id in group.request_ids]


# ---- streaming ---------------------------------------------------------------------------------
def sse(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump(mode="json")
        if data.get("usage", 0) is None:
            del data["usage"]  # OpenAI sends usage only in the final chunk, when asked
        payload = data
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_events(events: AsyncIterator[BaseModel], prompt_param: str) -> AsyncIterator[str]:
    """Frame `events` as SSE, then `[DONE]`. Errors after the headers went out can only be
    reported in-stream: an `{"error": ...}` event, which the openai client raises."""
    try:
        async for event in events:
            yield sse(event)
    except Disconnected:
        return
    except Exception as exc:
        try:
            error = api_error(exc, prompt_param)
            yield sse(error_body(error.message, error.error_type, error.param, error.code))
        except Exception:
            logger.exception("error while streaming")
            yield sse(error_body(f"internal server error: {exc!r}", "server_error", None, "internal_error"))
    yield SSE_DONE


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that releases its engine requests however it ends — finished, client
    gone (its KV blocks are freed at once), or failed before the first byte was sent."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[Any]]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def stream_response(
    served: ServedModel, request_id: str, prompts: list[EnginePrompt], params: SamplingParams, priority: int,
    prompt_param: str, events: Callable[[RequestGroup], AsyncIterator[BaseModel]], constraint_param: str | None = None,
) -> EngineStreamingResponse:
    """Submit first (so rejections are plain HTTP errors), then stream `events(group)`."""
    stack = AsyncExitStack()
    group = await stack.enter_async_context(submitted(served, request_id, prompts, params, priority, prompt_param, constraint_param))
    try:
        return EngineStreamingResponse(sse_events(events(group), prompt_param), stack.aclose)
    except BaseException:
        await stack.aclose()
        raise


# ---- outputs → response pieces -----------------------------------------------------------------
def token_text(served: ServedModel, token_id: int, logprob: Logprob | None = None, as_ids: bool = False) -> str:
    """A token as a string; "token_id:N" (vLLM's convention) when the model has no tokenizer or
    the request asked for ids (`return_tokens_as_token_ids`)."""
    if served.tokenizer is None or as_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return served.tokenizer.decode([token_id])


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def running_usage(prompts: list[EnginePrompt], outputs: dict[str, RequestOutput], generated=lambda c: c.token_ids) -> UsageInfo:
    """Usage so far: the prompts and every token generated until now (continuous_usage_stats)."""
    return usage(prompts, sum(len(generated(c)) for o in outputs.values() for c in o.outputs))


def usage(prompts: list[EnginePrompt], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)
