"""POST /v1/completions: prompts → engine requests → OpenAI `text_completion` objects.

One engine request per prompt; its n samples become choices `prompt_index * n + sample_index`.
Echo with logprobs returns the prompt tokens' logprobs (the first is null: nothing predicts it)
followed by the generated tokens' — what lm-evaluation-harness sends (echo=true, logprobs=1,
max_tokens=1) to score a continuation. max_tokens=0 with echo scores the prompt alone: the engine
generates one token, which is not returned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from pagedllm.entrypoints.openai import serving_beam_search
from pagedllm.entrypoints.openai.async_engine import RequestGroup
from pagedllm.entrypoints.openai.models import ServedModel
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedllm.entrypoints.openai.serving import (
    EnginePrompt,
    accept,
    check_context_length,
    check_logprob_volume,
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
from pagedllm.http_errors import BadRequestError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

PROMPT = "prompt"


async def to_prompts(req: CompletionRequest, served: ServedModel) -> list[EnginePrompt]:
    """The prompt field's four shapes as token ids, tokenized as the engine would (`encode`), on
    the model's tokenizer thread."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]  # type: ignore[list-item]
    if not raw:
        raise BadRequestError("prompt must not be empty", PROMPT)
    prompts = []
    tok = served.tokenizer
    for item in raw:
        if isinstance(item, str):
            if tok is None:
                raise BadRequestError(f"model {served.name!r} has no tokenizer; send the prompt as token ids", PROMPT)
            ids = truncate(await encode(served, item, PROMPT, req.add_special_tokens), req, served)
            text = item if req.truncate_prompt_tokens is None else await served.on_tokenizer_thread(tok.decode, ids)
            prompts.append(EnginePrompt(text, ids))
        else:
            ids = truncate(list(item), req, served)  # type: ignore[arg-type]
            echoed = tok is not None and req.echo and _in_vocab(ids, served)
            prompts.append(EnginePrompt(await served.on_tokenizer_thread(tok.decode, ids) if echoed else "", ids))
    return prompts


def _in_vocab(ids: list[int], served: ServedModel) -> bool:
    return all(0 <= t < served.vocab_size for t in ids)


async def create_completion(req: CompletionRequest, served: ServedModel, raw: Request) -> Response | CompletionResponse:
    accept(req)
    prompts = await to_prompts(req, served)
    for prompt in prompts:
        check_context_length(len(prompt.token_ids), req.max_tokens, served)
    if req.use_beam_search:
        if served.lora_request is not None:  # the searcher runs base-model requests only
            raise BadRequestError(f"use_beam_search is not supported with LoRA adapters (model {served.name!r})",
                                  "use_beam_search")
        return await beam_search_completion(req, served, raw, prompts)
    score_only = req.max_tokens == 0
    constraint, constraint_param = structured_outputs(req)
    params = sampling_params(
        req,
        served,
        max_tokens=1 if score_only else req.max_tokens,
        best_of=req.best_of,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
        structured_outputs=constraint,
    )
    check_logprob_volume([len(p.token_ids) for p in prompts], params, served)
    builder = CompletionBuilder(req, served, raw, new_id("cmpl", req.request_id), prompts)
    if req.stream:
        return await stream_response(served, builder.id, prompts, params, req.priority, PROMPT, builder.chunks, constraint_param)
    async with submitted(served, builder.id, prompts, params, req.priority, PROMPT, constraint_param) as group:
        outputs = await final_outputs(group, raw, PROMPT)
    return builder.response(outputs)


async def beam_search_completion(req: CompletionRequest, served: ServedModel, raw: Request,
                                 prompts: list[EnginePrompt]) -> CompletionResponse:
    """Each prompt's beam search (serving_beam_search.py): width best_of (else n), the n best
    hypotheses as its choices, best first."""
    if req.max_tokens == 0:
        raise BadRequestError("max_tokens=0 (scoring the prompt) cannot be used with use_beam_search", "max_tokens")
    _, constraint_param = structured_outputs(req)
    width_param = "best_of" if req.best_of is not None else "n"
    params = serving_beam_search.beam_search_params(
        req, req.max_tokens if req.max_tokens is not None else served.max_model_len,
        width=req.best_of if req.best_of is not None else req.n, width_param=width_param,
        logprobs_param="logprobs" if req.logprobs is not None else None, constraint_param=constraint_param)
    builder = CompletionBuilder(req, served, raw, new_id("cmpl", req.request_id), prompts)
    outputs = await serving_beam_search.search_outputs(served, builder.id, prompts, params, req.n, req.priority, raw, PROMPT,
                                                       width_param, req.skip_special_tokens)
    return builder.response(outputs)


@dataclass
class _ChoiceState:
    """What a stream already sent for one choice."""

    text_len: int = 0
    num_tokens: int = 0
    offset: int = 0  # characters sent, echo included (text_offset origin)
    echoed: bool = False
    done: bool = False


@dataclass
class CompletionBuilder:
    req: CompletionRequest
    served: ServedModel
    raw: Request
    id: str
    prompts: list[EnginePrompt]
    created: int = field(default_factory=now)

    @property
    def score_only(self) -> bool:
        return self.req.max_tokens == 0

    def _generated(self, completion: CompletionOutput) -> tuple[str, list[int]]:
        return ("", []) if self.score_only else (completion.text, completion.token_ids)

    def _finish_reason(self, completion: CompletionOutput) -> str | None:
        if completion.finish_reason is None:
            return None
        return "length" if self.score_only and completion.finish_reason != "abort" else completion.finish_reason

    # ---- whole response ----
    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for p_index, output in enumerate(outputs):
            for completion in output.outputs:
                choices.append(self._choice(p_index, output, completion))
                completion_tokens += len(self._generated(completion)[1])
        return CompletionResponse(
            id=self.id, created=self.created, model=self.served.name, choices=choices,
            usage=usage(self.prompts, completion_tokens),
        )

    def _choice(self, p_index: int, output: RequestOutput, completion: CompletionOutput) -> CompletionChoice:
        text, token_ids = self._generated(completion)
        prompt = self.prompts[p_index]
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = LogprobsBuilder(self.served, as_ids=self.req.return_tokens_as_token_ids)
            if self.req.echo:
                logprobs.add_prompt(prompt.token_ids, output.prompt_logprobs)
            logprobs.add(token_ids, completion.logprobs)
        return CompletionChoice(
            index=p_index * self.req.n + completion.index,
            text=(prompt.text if self.req.echo else "") + text,
            logprobs=logprobs.result if logprobs else None,
            finish_reason=self._finish_reason(completion),
            stop_reason=completion.stop_reason,
        )

    # ---- stream ----
    async def chunks(self, group: RequestGroup) -> AsyncIterator[CompletionResponse]:
        states: dict[int, _ChoiceState] = {}
        p_index = {request_id: i for i, request_id in enumerate(group.request_ids)}
        async for changed in group.updates(self.raw.is_disconnected):
            for output in changed:
                for completion in output.outputs:
                    choice = self._delta(p_index[output.request_id], output, completion, states)
                    if choice is not None:
                        so_far = running_usage(self.prompts, group.outputs, lambda c: self._generated(c)[1])
                        yield CompletionResponse(id=self.id, created=self.created, model=self.served.name, choices=[choice],
                                                 usage=so_far if self.req.continuous_usage else None)
        if self.req.final_usage:
            final = [group.outputs[request_id] for request_id in group.request_ids]
            tokens = sum(len(self._generated(c)[1]) for o in final for c in o.outputs)
            yield CompletionResponse(
                id=self.id, created=self.created, model=self.served.name, choices=[], usage=usage(self.prompts, tokens)
            )

    def _delta(self, p_index: int, output: RequestOutput, completion: CompletionOutput, states: dict[int, _ChoiceState]) -> CompletionChoice | None:
        index = p_index * self.req.n + completion.index
        state = states.setdefault(index, _ChoiceState())
        if state.done:
            return None
        text, token_ids = self._generated(completion)
        finish = self._finish_reason(completion)
        new_tokens = token_ids[state.num_tokens :]
        if not (new_tokens or finish):
            return None  # nothing new (a prefill chunk), or the prompt is not fully scored yet
        delta = text[state.text_len :]
        logprobs = (LogprobsBuilder(self.served, state.offset, self.req.return_tokens_as_token_ids)
                    if self.req.logprobs is not None else None)
        if self.req.echo and not state.echoed:
            prompt = self.prompts[p_index]
            delta = prompt.text + delta
            if logprobs:
                logprobs.add_prompt(prompt.token_ids, output.prompt_logprobs)
            state.echoed = True
        if logprobs:
            logprobs.add(new_tokens, (completion.logprobs or [])[state.num_tokens : len(token_ids)])
        # A token that completes no character yet still gets its (empty) chunk, as in vLLM:
        # clients see progress, and a model without a tokenizer streams at all.
        state.text_len, state.num_tokens, state.done = len(text), len(token_ids), finish is not None
        state.offset += len(delta)
        return CompletionChoice(
            index=index, text=delta, logprobs=logprobs.result if logprobs else None,
            finish_reason=finish, stop_reason=completion.stop_reason if finish else None,
        )


class LogprobsBuilder:
    """OpenAI's legacy logprobs: parallel lists of tokens, their logprobs, top alternatives and
    character offsets (each token's start in the returned text, echo included)."""

    def __init__(self, served: ServedModel, offset: int = 0, as_ids: bool = False):
        self.served = served
        self.offset = offset
        self.as_ids = as_ids
        self.result = CompletionLogprobs()

    def add_prompt(self, token_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None) -> None:
        entries = list(prompt_logprobs or [])
        entries += [None] * (len(token_ids) - len(entries))
        for token_id, entry in zip(token_ids, entries):
            self._add_one(token_id, entry)

    def add(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> None:
        entries = list(logprobs or [])
        for i, token_id in enumerate(token_ids):
            self._add_one(token_id, entries[i] if i < len(entries) else None)

    def _add_one(self, token_id: int, entry: dict[int, Logprob] | None) -> None:
        chosen = entry.get(token_id) if entry else None
        token = token_text(self.served, token_id, chosen, self.as_ids)
        r = self.result
        r.tokens.append(token)
        r.text_offset.append(self.offset)
        self.offset += len(token)
        r.token_logprobs.append(clamp(chosen.logprob) if chosen else None)
        r.top_logprobs.append(self._top(entry) if entry else None)

    def _top(self, entry: dict[int, Logprob]) -> dict[str, float]:
        """Keyed by token text, as OpenAI's format is: tokens that decode alike (say, partial
        UTF-8 bytes shown as U+FFFD) share a key, which keeps its best-ranked logprob."""
        top: dict[str, float] = {}
        for token_id, logprob in sorted(entry.items(), key=lambda item: item[1].rank):
            top.setdefault(token_text(self.served, token_id, logprob, self.as_ids), clamp(logprob.logprob))
        return top
