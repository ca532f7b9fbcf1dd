"""POST /v1/chat/completions: messages → the model's chat template → one engine request.

The template is the request's `chat_template` (with --trust-request-chat-template), else the
server's --chat-template, else the model's own; transformers' `apply_chat_template` renders it in
its sandboxed Jinja environment; the rendered text is tokenized without extra special tokens (the
template places BOS itself, as vLLM does). A model without a template gets a clear 400.
Streams send each choice's role first, then content deltas, then its finish_reason.
With `tools`, the template is given them (a template that knows no tools gets the fallback of
tool_prompt.py) and the answer's tool calls are parsed out of the text by the server's tool-call
parser (tool_calls.py); a choice that called a tool finishes with "tool_calls".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from pagedllm.entrypoints import chat_template
from pagedllm.entrypoints.openai import serving_beam_search
from pagedllm.entrypoints.openai.async_engine import RequestGroup
from pagedllm.entrypoints.openai.models import ServedModel
from pagedllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChoiceLogprobs,
    DeltaMessage,
    DeltaToolCall,
    TopLogprob,
)
from pagedllm.entrypoints.openai.serving import (
    EnginePrompt,
    accept,
    check_context_length,
    check_logprob_volume,
    check_prompt_chars,
    clamp,
    encode,
    final_outputs,
    new_id,
    now,
    running_usage,
    sampling_params,
    stream_response,
    structured_outputs,
    submitted,
    token_text,
    truncate,
    usage,
)
from pagedllm.entrypoints.openai.tool_calls import (
    ToolCallStream,
    extract_tool_calls,
    parses_calls,
    template_message,
    template_tools,
    tool_constraint,
)
from pagedllm.http_errors import BadRequestError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import StructuredOutputsParams

MESSAGES = "messages"


async def render_chat(req: ChatCompletionRequest, served: ServedModel) -> EnginePrompt:
    """The messages through the model's chat template (or the request's), tokenized; both on the
    model's tokenizer thread, after the messages' length is checked (what the template adds is
    not counted)."""
    if served.tokenizer is None:
        raise BadRequestError(f"model {served.name!r} has no tokenizer; use /v1/completions with token ids", MESSAGES)
    check_prompt_chars(served, sum(len(message.text() or "") for message in req.messages), MESSAGES)
    messages = [template_message(message) for message in req.messages]
    try:
        text = await served.on_tokenizer_thread(
            chat_template.render_chat, served.tokenizer, messages, tools=template_tools(req),
            chat_template=request_template(req, served), tool_parser=served.tool_parser,
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            documents=req.documents, chat_template_kwargs=req.chat_template_kwargs)
    except chat_template.ChatTemplateError as exc:
        raise BadRequestError(f"model {served.name!r}: {exc}", template_param(req, str(exc))) from exc
    token_ids = await encode(served, text, MESSAGES, add_special_tokens=req.add_special_tokens)
    ids = truncate(token_ids, req, served)
    return EnginePrompt(text if ids is token_ids else served.tokenizer.decode(ids), ids)


def request_template(req: ChatCompletionRequest, served: ServedModel) -> str | None:
    """The template to render with (None: the model's own); a request's only when the server trusts it."""
    if req.chat_template is not None and not served.chat.trust_request_chat_template:
        raise BadRequestError("chat_template: a template is code; this server renders a request's template only when "
                              "started with --trust-request-chat-template (as vLLM)", "chat_template")
    return req.chat_template or served.chat.chat_template


def template_param(req: ChatCompletionRequest, reason: str) -> str:
    """The field a template error is about: the kwargs it clashed with, the request's template, or the messages."""
    if "chat_template_kwargs" in reason:
        return "chat_template_kwargs"
    return "chat_template" if req.chat_template is not None else MESSAGES


async def create_chat_completion(req: ChatCompletionRequest, served: ServedModel, raw: Request) -> Response | ChatCompletionResponse:
    accept(req)
    prompt = await render_chat(req, served)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_context_length(len(prompt.token_ids), max_tokens, served, param)
    check_tool_choice(req, served)
    constraint, constraint_param = output_constraint(req, served)
    if req.use_beam_search:
        if served.lora_request is not None:  # the searcher runs base-model requests only
            raise BadRequestError(f"use_beam_search is not supported with LoRA adapters (model {served.name!r})",
                                  "use_beam_search")
        return await beam_search_chat(req, served, raw, prompt, max_tokens, constraint_param)
    params = sampling_params(
        req, served, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        structured_outputs=constraint,
    )
    check_logprob_volume([len(prompt.token_ids)], params, served)
    builder = ChatBuilder(req, served, raw, new_id("chatcmpl", req.request_id), prompt)
    if req.stream:
        return await stream_response(served, builder.id, [prompt], params, req.priority, MESSAGES, builder.chunks, constraint_param)
    async with submitted(served, builder.id, [prompt], params, req.priority, MESSAGES, constraint_param) as group:
        (output,) = await final_outputs(group, raw, MESSAGES)
    return builder.response(output)


async def beam_search_chat(req: ChatCompletionRequest, served: ServedModel, raw: Request, prompt: EnginePrompt,
                           max_tokens: int | None, constraint_param: str | None) -> ChatCompletionResponse:
    """The conversation's beam search (serving_beam_search.py): width n, all n beams as choices."""
    params = serving_beam_search.beam_search_params(
        req, max_tokens if max_tokens is not None else served.max_model_len, width=req.n, width_param="n",
        logprobs_param="logprobs" if req.logprobs else None, constraint_param=constraint_param)
    builder = ChatBuilder(req, served, raw, new_id("chatcmpl", req.request_id), prompt)
    (output,) = await serving_beam_search.search_outputs(served, builder.id, [prompt], params, req.n, req.priority, raw,
                                                         MESSAGES, "n", req.skip_special_tokens)
    return builder.response(output)


def check_tool_choice(req: ChatCompletionRequest, served: ServedModel) -> None:
    """vLLM's rule: "auto" (the default with tools) needs --enable-auto-tool-choice."""
    if req.tools and req.tool_choice in (None, "auto") and not served.chat.enable_auto_tool_choice:
        raise BadRequestError('tool_choice "auto" needs a server started with --enable-auto-tool-choice; '
                              'use "required", a named function or "none"', "tool_choice")


def output_constraint(req: ChatCompletionRequest, served: ServedModel) -> tuple[StructuredOutputsParams | None, str | None]:
    """A response format / guided constraint, or the grammar a forced tool choice implies."""
    constraint, param = structured_outputs(req, req.response_format)
    calls = tool_constraint(req, served.tool_parser)
    if calls is None:
        return constraint, param
    if constraint is not None:
        raise BadRequestError(f"tool_choice {req.tool_choice!r} cannot be combined with {param}", "tool_choice")
    return calls, "tool_choice"


@dataclass
class ChatBuilder:
    req: ChatCompletionRequest
    served: ServedModel
    raw: Request
    id: str
    prompt: EnginePrompt
    created: int = field(default_factory=now)
    parsers: dict[int, ToolCallStream] = field(default_factory=dict)  # choice -> its stream's parser

    @staticmethod
    def _finish_reason(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" else reason

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in output.outputs:
            content, calls = extract_tool_calls(c.text, self.served.tool_parser) if parses_calls(self.req) else (c.text, [])
            choices.append(ChatChoice(
                index=c.index,
                message=AssistantMessage(content=content, tool_calls=calls),
                logprobs=self._logprobs(c.token_ids, c.logprobs),
                finish_reason=self._finish_reason(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason,
            ))
        tokens = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.served.name, choices=choices, usage=usage([self.prompt], tokens)
        )

    def _chunk(self, choices: list[ChatStreamChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.served.name, choices=choices, **extra)

    async def chunks(self, group: RequestGroup) -> AsyncIterator[ChatCompletionChunk]:
        opening = usage([self.prompt], 0) if self.req.continuous_usage else None
        for index in range(self.req.n):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))], usage=opening)
        sent: dict[int, tuple[int, int]] = {}  # choice -> (characters, tokens) sent
        done: set[int] = set()
        async for changed in group.updates(self.raw.is_disconnected):
            for completion in changed[0].outputs:
                choice = self._delta(completion, sent, done)
                if choice is not None:
                    so_far = running_usage([self.prompt], group.outputs) if self.req.continuous_usage else None
                    yield self._chunk([choice], usage=so_far)
        if self.req.final_usage:
            (final,) = group.outputs.values()
            tokens = sum(len(c.token_ids) for c in final.outputs)
            yield self._chunk([], usage=usage([self.prompt], tokens))

    def _delta(self, c: CompletionOutput, sent: dict[int, tuple[int, int]], done: set[int]) -> ChatStreamChoice | None:
        if c.index in done:
            return None
        chars, tokens = sent.get(c.index, (0, 0))
        delta = c.text[chars:]
        new_tokens = c.token_ids[tokens:]
        if not (delta or c.finish_reason or (new_tokens and self.req.logprobs)):
            return None
        sent[c.index] = (len(c.text), len(c.token_ids))
        if c.finish_reason is not None:
            done.add(c.index)
        new_logprobs = (c.logprobs or [])[tokens : len(c.token_ids)]
        message, called = self._message_delta(c.index, delta, c.finish_reason is not None)
        if not (message.content or message.tool_calls or c.finish_reason or (new_tokens and self.req.logprobs)):
            return None  # text held back: it may open a tool call
        return ChatStreamChoice(
            index=c.index,
            delta=message,
            logprobs=self._logprobs(new_tokens, new_logprobs),
            finish_reason=self._finish_reason(c.finish_reason, called),
            stop_reason=c.stop_reason if c.finish_reason else None,
        )

    def _message_delta(self, index: int, text: str, last: bool) -> tuple[DeltaMessage, bool]:
        """The delta's content and completed tool calls; whether this choice has called a tool."""
        if not parses_calls(self.req):
            return (DeltaMessage(content=text) if text else DeltaMessage()), False
        parser = self.parsers.setdefault(index, ToolCallStream(self.served.tool_parser()))
        first = parser.calls
        content, calls = parser.feed(text)
        if last:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        deltas = [DeltaToolCall(index=first + i, **call.model_dump()) for i, call in enumerate(calls)] or None
        return DeltaMessage(content=content or None, tool_calls=deltas), parser.calls > 0

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]] | None) -> ChoiceLogprobs | None:
        if not self.req.logprobs:
            return None
        top_n = self.req.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, entries or []):
            chosen = entry[token_id]
            tops = sorted((item for item in entry.items() if item[1].rank <= top_n), key=lambda item: item[1].rank)
            content.append(
                ChatTokenLogprob(
                    **self._top(token_id, chosen),
                    top_logprobs=[TopLogprob(**self._top(tid, lp)) for tid, lp in tops[:top_n]],
                )
            )
        return ChoiceLogprobs(content=content)

    def _top(self, token_id: int, logprob: Logprob) -> dict:
        token = token_text(self.served, token_id, logprob, self.req.return_tokens_as_token_ids)
        return {"token": token, "logprob": clamp(logprob.logprob), "bytes": list(token.encode("utf-8"))}
