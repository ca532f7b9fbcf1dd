"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's fields).

The search is the one `LLM.beam_search` runs (engine/beam_search.py: transformers' ranking,
`length_penalty`, `early_stopping`), driven from the event loop instead of an engine loop: each
round, every live beam is an ordinary one-token request for its top-K next tokens, submitted as
one group through the model's `AsyncEngine` (so rounds join the running batch like any request,
the beams share KV through the prefix cache, and the event loop only awaits), and between rounds
`BeamSearch.step` ranks the continuations — a few microseconds of Python per round.

Width: `best_of` when given (completions), else `n`; the `n` best hypotheses come back as the
choices, best score first. Sampling fields (temperature, top_p, top_k, min_p, seed) are ignored,
as vLLM's beam search ignores them: the search is deterministic. Fields the search cannot
honour are a 400 naming them: `stream` (the best beams are known only at the end), `logprobs`,
output constraints and tools that force a call, stop strings and ids, penalties, `min_tokens`,
`logit_bias` and `allowed_token_ids`.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

from fastapi import Request

from pagedllm.engine.beam_search import Beam, BeamSearch, advance, candidates, new_search, round_params
from pagedllm.entrypoints.openai.async_engine import EngineStoppedError
from pagedllm.entrypoints.openai.errors import param_from_message
from pagedllm.entrypoints.openai.metrics import BEAM_ROUND_MARK
from pagedllm.entrypoints.openai.models import ServedModel
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.entrypoints.openai.serving import EnginePrompt, final_outputs, submitted
from pagedllm.http_errors import BadRequestError, ServiceUnavailableError
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams

_NO_BEAMS = "beam search ends hypotheses on EOS and max_tokens only"
_RAW = "beam search ranks the model's own logprobs"
# field -> (whether its value asks for something, why beam search cannot honour it)
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (bool, "beam search does not stream: the best beams are known only when the search ends; send stream=false"),
    "stop": (bool, _NO_BEAMS),
    "stop_token_ids": (bool, _NO_BEAMS),
    "presence_penalty": (lambda v: v not in (None, 0), _RAW + "; penalties are not applied"),
    "frequency_penalty": (lambda v: v not in (None, 0), _RAW + "; penalties are not applied"),
    "repetition_penalty": (lambda v: v not in (None, 1), _RAW + "; penalties are not applied"),
    "min_tokens": (bool, "beam search does not hold EOS back"),
    "logit_bias": (bool, _RAW + "; a bias is not applied"),
    "allowed_token_ids": (lambda v: v is not None, _RAW + " over the whole vocabulary"),
}


def beam_search_params(req: SamplingFields, max_tokens: int, *, width: int, width_param: str,
                       logprobs_param: str | None, constraint_param: str | None) -> BeamSearchParams:
    """The request's BeamSearchParams, or a 400 naming a field the search cannot honour."""
    for name, (asks, reason) in _REFUSED.items():
        if asks(getattr(req, name)):
            raise BadRequestError(f"{name} cannot be used with use_beam_search: {reason}", name)
    if logprobs_param is not None:
        raise BadRequestError(f"{logprobs_param} cannot be used with use_beam_search: the hypotheses carry no "
                              "alternatives per token", logprobs_param)
    if constraint_param is not None:
        raise BadRequestError(f"{constraint_param} cannot be used with use_beam_search: beams are not constrained",
                              constraint_param)
    if req.n > width:
        raise BadRequestError(f"best_of must be >= n, got best_of={width} and n={req.n}", "best_of")
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty, early_stopping=req.early_stopping)
    except ValueError as exc:
        param = param_from_message(str(exc), ["length_penalty", "early_stopping", "max_tokens"])
        raise BadRequestError(str(exc).replace("beam_width", width_param), param or width_param) from exc


def start(served: ServedModel, prompt: EnginePrompt, params: BeamSearchParams, width_param: str) -> BeamSearch:
    """The prompt's search (checked before any round runs: a width too wide is a 400)."""
    try:
        return new_search(params, served.eos_token_ids, served.max_model_len, served.vocab_size, len(prompt.token_ids))
    except ValueError as exc:
        raise BadRequestError(str(exc).replace("beam_width", width_param), width_param) from exc


async def run(served: ServedModel, search_id: str, prompt: EnginePrompt, search: BeamSearch, priority: int,
              raw: Request, prompt_param: str) -> BeamSearch:
    """Round after round until the search is done: each round's beams are one request group,
    aborted if the client leaves (final_outputs), and the search ranks their next tokens."""
    beams = [Beam()]
    for round_index in itertools.count():
        prompts = [EnginePrompt(prompt.text, prompt.token_ids + beam.output_ids) for beam in beams]
        async with submitted(served, f"{search_id}{BEAM_ROUND_MARK}{round_index}", prompts, round_params(search), priority,
                             prompt_param) as group:
            outputs = await final_outputs(group, raw, prompt_param)
        for beam, output in zip(beams, outputs):
            if output.outputs[0].finish_reason == "error":  # the engine ended it (LLMEngine.step); logged there
                raise ServiceUnavailableError(f"a step of the beam search failed: {output.outputs[0].stop_reason}",
                                              code="request_failed")
            if output.outputs[0].finish_reason == "abort" or not output.outputs[0].logprobs:
                raise EngineStoppedError(f"model {served.name!r} stopped while the beam search ran")
            beam.candidates = candidates(output)
        beams = advance(search, beams)
        if search.done:
            return search
    raise AssertionError("unreachable")


async def search_outputs(served: ServedModel, request_id: str, prompts: list[EnginePrompt], params: BeamSearchParams,
                         n: int, priority: int, raw: Request, prompt_param: str, width_param: str,
                         skip_special_tokens: bool) -> list[RequestOutput]:
    """Every prompt's search, run concurrently; each as a RequestOutput of its `n` best
    hypotheses (text without a final EOS, as vLLM returns it), best first."""
    searches = [start(served, prompt, params, width_param) for prompt in prompts]
    tasks = [asyncio.ensure_future(run(served, f"{request_id}-{index}", prompt, search, priority, raw, prompt_param))
             for index, (prompt, search) in enumerate(zip(prompts, searches))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:  # the first failure is the answer; the other searches are aborted
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    outputs = [await _output(served, f"{request_id}-{index}", prompt, search, n, skip_special_tokens)
               for index, (prompt, search) in enumerate(zip(prompts, searches))]
    raw.app.state.metrics.searched(served.name, outputs)  # the rounds were not counted (metrics.BEAM_ROUND_MARK)
    return outputs


async def _output(served: ServedModel, request_id: str, prompt: EnginePrompt, search: BeamSearch, n: int,
                  skip_special_tokens: bool) -> RequestOutput:
    completions = []
    for index, hypothesis in enumerate(search.finished[:n]):
        tokens = hypothesis.token_ids
        shown = tokens[:-1] if hypothesis.finish_reason == "stop" else tokens
        text = ""
        if served.tokenizer is not None:
            text = await served.on_tokenizer_thread(served.tokenizer.decode, shown, skip_special_tokens=skip_special_tokens)
        completions.append(CompletionOutput(index, text, list(tokens), hypothesis.cumulative_logprob, None,
                                            hypothesis.finish_reason))
    return RequestOutput(request_id, prompt.text, prompt.token_ids, completions, finished=True)
