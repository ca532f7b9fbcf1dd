"""POST /v1/chat/completions: messages → the model's chat template → one engine request.

The template comes from the model's tokenizer files and is rendered by transformers'
`apply_chat_template`; the rendered text is tokenized without extra special tokens (the
template places BOS itself, as vLLM does). A model without a template gets a clear 400.
Streams send each choice's role first, then content deltas, then its finish_reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from pagedllm.entrypoints.openai.async_engine import RequestGroup
from pagedllm.entrypoints.openai.errors import BadRequestError
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
    TopLogprob,
)
from pagedllm.entrypoints.openai.serving import (
    EnginePrompt,
    check_context_length,
    clamp,
    final_outputs,
    new_id,
    now,
    sampling_params,
    stream_response,
    structured_outputs,
    submitted,
    token_text,
    usage,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

MESSAGES = "messages"


def render_chat(req: ChatCompletionRequest, served: ServedModel) -> EnginePrompt:
    tok = served.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise BadRequestError(
            f"model {served.name!r} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); use /v1/completions instead",
            MESSAGES,
        )
    messages = []
    for message in req.messages:
        item = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        messages.append(item)
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt)
    except Exception as exc:  # jinja2 errors, e.g. a template that enforces role alternation
        raise BadRequestError(f"the chat template of model {served.name!r} rejected the messages: {exc}", MESSAGES) from exc
    return EnginePrompt(text, tok.encode(text, add_special_tokens=False))


async def create_chat_completion(req: ChatCompletionRequest, served: ServedModel, raw: Request) -> Response | ChatCompletionResponse:
    prompt = render_chat(req, served)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_context_length(len(prompt.token_ids), max_tokens, served.max_model_len, param)
    constraint, constraint_param = structured_outputs(req, req.response_format)
    params = sampling_params(
        req, served, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        structured_outputs=constraint,
    )
    builder = ChatBuilder(req, served, raw, new_id("chatcmpl"), prompt)
    if req.stream:
        return await stream_response(served, builder.id, [prompt], params, req.priority, MESSAGES, builder.chunks, constraint_param)
    async with submitted(served, builder.id, [prompt], params, req.priority, MESSAGES, constraint_param) as group:
        (output,) = await final_outputs(group, raw, MESSAGES)
    return builder.response(output)


@dataclass
class ChatBuilder:
    req: ChatCompletionRequest
    served: ServedModel
    raw: Request
    id: str
    prompt: EnginePrompt
    created: int = field(default_factory=now)

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=self._logprobs(c.token_ids, c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in output.outputs
        ]
        tokens = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.served.name, choices=choices, usage=usage([self.prompt], tokens)
        )

    def _chunk(self, choices: list[ChatStreamChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.served.name, choices=choices, **extra)

    async def chunks(self, group: RequestGroup) -> AsyncIterator[ChatCompletionChunk]:
        for index in range(self.req.n):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        sent: dict[int, tuple[int, int]] = {}  # choice -> (characters, tokens) sent
        done: set[int] = set()
        async for changed in group.updates(self.raw.is_disconnected):
            for completion in changed[0].outputs:
                choice = self._delta(completion, sent, done)
                if choice is not None:
                    yield self._chunk([choice])
        if self.req.stream_options and self.req.stream_options.include_usage:
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
        return ChatStreamChoice(
            index=c.index,
            delta=DeltaMessage(content=delta) if delta else DeltaMessage(),
            logprobs=self._logprobs(new_tokens, new_logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if c.finish_reason else None,
        )

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
        token = token_text(self.served, token_id, logprob)
        return {"token": token, "logprob": clamp(logprob.logprob), "bytes": list(token.encode("utf-8"))}
