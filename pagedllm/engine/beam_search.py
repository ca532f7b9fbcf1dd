"""Beam search as a layer over the engine (vLLM's `LLM.beam_search`), by transformers' `num_beams`
rules, so results equal its `generate`.

Why a layer: the scheduler knows only ordinary requests. Each round, every live beam of a search
is a one-token request whose prompt is the beam so far, asking for its top-K next tokens; the
beams' KV is shared through the prefix cache (a beam's full blocks are those its parent's request
published), so a round recomputes at most each beam's last, partly filled block. Once every beam
of a round has its next-token distribution, `BeamSearch.step` ranks all beam × token
continuations by cumulative logprob and keeps the best K = max(2, 1 + #EOS) × width of them:

- among the best `width`, those that end on EOS (or reach `max_tokens`) become hypotheses,
  scored cumulative logprob / generated length ** length_penalty; the best `width` are kept;
- the best `width` that did not end become next round's beams (a beam picked several times
  becomes several requests, sharing its blocks through the cache);
- the search ends when no continuation can go on, or when all `width` hypothesis slots are full
  and (by `early_stopping`, transformers' rules) at once (True), or once the best running beam,
  scored at its current length, cannot beat the worst of them (False, the default heuristic), or
  scored at `max_tokens` when length_penalty > 0 ("never": the exact bound).

K > width keeps `width` beams alive even when the best continuations all end.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.engine.llm_engine import MAX_LOGPROBS
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine, PromptType  # noqa: F401


@dataclass
class Beam:
    """One live hypothesis: its output tokens with their (logprob, rank), and once its round's
    request has run, its top-K next tokens as (token, logprob), best first."""

    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    candidates: list[tuple[int, float]] | None = None


@dataclass
class Continuation:
    parent: Beam
    token_id: int
    logprob: float
    rank: int  # 1-based, within the parent's next-token distribution
    score: float  # the parent's cumulative logprob + logprob


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (the EOS included when it ended on one)."""

    token_ids: list[int]
    token_logprobs: list[tuple[float, int]]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"


def beam_score(cumulative_logprob: float, num_generated: int, length_penalty: float) -> float:
    return cumulative_logprob / (num_generated**length_penalty)


class BeamSearch:
    """One prompt's search state: the ranking rules, independent of how beams are computed."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int], max_new_tokens: int):
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.max_new_tokens = max_new_tokens
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * self.width
        self.num_generated = 0
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.done = False

    def step(self, beams: list[Beam]) -> list[Continuation]:
        """Rank the beams' continuations; returns the (up to `width`) beams to go on with, best
        first, and records finished hypotheses. Sets `done` when the search is over."""
        ranked = self._rank(beams)
        length = self.num_generated + 1
        ends = [c.token_id in self.eos_token_ids or length >= self.max_new_tokens for c in ranked]
        for cont, ended in zip(ranked[: self.width], ends):
            if ended:
                self._add_hypothesis(cont, length)
        self.num_generated = length
        going_on = [c for c, ended in zip(ranked, ends) if not ended][: self.width]
        self.done = not going_on or not self._improvable(going_on[0])
        return [] if self.done else going_on

    def _rank(self, beams: list[Beam]) -> list[Continuation]:
        conts = []
        for beam in beams:
            for rank, (token, logprob) in enumerate(beam.candidates, start=1):
                conts.append(Continuation(beam, token, logprob, rank, beam.cumulative_logprob + logprob))
        conts.sort(key=lambda c: c.score, reverse=True)  # stable: ties keep beam, then token rank order
        return conts[: self.num_candidates]

    def _add_hypothesis(self, cont: Continuation, length: int) -> None:
        parent = cont.parent
        hypothesis = Hypothesis(
            token_ids=parent.output_ids + [cont.token_id],
            token_logprobs=parent.token_logprobs + [(cont.logprob, cont.rank)],
            cumulative_logprob=cont.score,
            score=beam_score(cont.score, length, self.length_penalty),
            finish_reason="stop" if cont.token_id in self.eos_token_ids else "length",
        )
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def _improvable(self, best: Continuation) -> bool:
        """Could the best running beam still beat the worst kept hypothesis? With all `width`
        slots full: never with early_stopping=True; judged at the current length (False,
        transformers' default heuristic), or at the longest length it may reach when a positive
        length penalty favours longer ones ("never")."""
        if len(self.finished) < self.width:
            return True
        if self.early_stopping is True:
            return False
        length = self.num_generated
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_new_tokens
        return beam_score(best.score, length, self.length_penalty) > self.finished[-1].score


# ---- one search's rounds, whoever drives the engine (BeamSearcher here, the server's async loop) ----
def new_search(params: BeamSearchParams, eos_token_ids: frozenset[int], max_model_len: int, vocab_size: int,
               prompt_len: int) -> BeamSearch:
    """A prompt's search; ValueError for a width with more candidates per beam than a request's
    logprobs can give."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    search = BeamSearch(params, eos_token_ids, min(params.max_tokens, max_model_len - prompt_len))
    limit = min(MAX_LOGPROBS, vocab_size)
    if search.num_candidates > limit:
        raise ValueError(f"beam_width={params.beam_width} is too wide: each step ranks {search.num_candidates} "
                         f"continuations per beam, and at most {limit} are available")
    return search


def round_params(search: BeamSearch) -> SamplingParams:
    """What each beam of a round asks the engine for: one greedy token and its top-K logprobs."""
    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=search.num_candidates)


def candidates(output: RequestOutput) -> list[tuple[int, float]]:
    """A beam's finished round request as its next tokens (token, logprob), best first."""
    ranked = sorted(output.outputs[0].logprobs[0].items(), key=lambda item: item[1].rank)
    return [(token, entry.logprob) for token, entry in ranked]


def advance(search: BeamSearch, beams: list[Beam]) -> list[Beam]:
    """The search's step over a round whose beams all have their candidates: next round's beams
    (none once `search.done`)."""
    going_on = search.step(beams)
    return [Beam(c.parent.output_ids + [c.token_id], c.parent.token_logprobs + [(c.logprob, c.rank)], c.score)
            for c in going_on]


@dataclass
class _Search:
    prompt_ids: list[int]
    search: BeamSearch
    beams: list[Beam]
    pending: dict[str, Beam] = field(default_factory=dict)  # this round's request id -> its beam


class BeamSearcher:
    """Runs beam searches over an engine's ordinary requests. `step()` is one engine step: it
    hands back the engine's outputs of every other request, and starts a search's next round
    once its current one has run; finished searches are in `results`."""

    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.results: dict[str, BeamSearchOutput] = {}
        self._searches: dict[str, _Search] = {}
        self._owner: dict[str, str] = {}  # a round's request id -> its search id
        self._ids = itertools.count()

    def add(self, search_id: str, prompt: "PromptType", params: BeamSearchParams) -> None:
        """Start a search: its first round's single beam is the prompt itself. ValueError for
        what the engine refuses (the prompt) and for a width with too many candidates per beam."""
        engine = self.engine
        _, prompt_ids = engine.tokenize(prompt)
        search = new_search(params, engine.eos_token_ids, engine.max_model_len, engine.model_config.vocab_size, len(prompt_ids))
        state = _Search(prompt_ids, search, [Beam()])
        self._submit(search_id, state)  # the engine checks the prompt
        self._searches[search_id] = state

    def has_unfinished(self) -> bool:
        return bool(self._searches)

    def abort(self, search_id: str) -> None:
        state = self._searches.pop(search_id, None)
        for request_id in state.pending if state is not None else ():
            self._owner.pop(request_id, None)
            self.engine.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        others = []
        for output in self.engine.step():
            search_id = self._owner.get(output.request_id)
            if search_id is None:
                others.append(output)
            elif output.finished:
                failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
                if failed is not None:  # the engine ended the round's request (LLMEngine.step)
                    self.abort(search_id)
                    raise RuntimeError(f"beam search {search_id!r}: {failed.stop_reason}")
                self._take(search_id, output)
        return others

    def _submit(self, search_id: str, state: _Search) -> None:
        """One one-token request per live beam, asking for its top-K next tokens."""
        params = round_params(state.search)
        for beam in state.beams:
            request_id = f"{search_id}/beam-{next(self._ids)}"
            self.engine.add_request(request_id, {"prompt_token_ids": state.prompt_ids + beam.output_ids}, params)
            state.pending[request_id] = beam
            self._owner[request_id] = search_id

    def _take(self, search_id: str, output: RequestOutput) -> None:
        """A beam's next-token distribution; with the round's last one, the search's step."""
        self._owner.pop(output.request_id)
        state = self._searches[search_id]
        state.pending.pop(output.request_id).candidates = candidates(output)
        if state.pending:
            return
        state.beams = advance(state.search, state.beams)
        if state.search.done:
            del self._searches[search_id]
            self.results[search_id] = self._output(state)
        else:
            self._submit(search_id, state)

    def _output(self, state: _Search) -> BeamSearchOutput:
        """The hypotheses, best score first, with the prompt in their tokens and text."""
        tokenizer, decode = self.engine.tokenizer, self.engine.output_processor.detokenizer.decode_token
        sequences = []
        for hyp in state.search.finished:
            tokens = state.prompt_ids + hyp.token_ids
            logprobs = [{token: Logprob(logprob, rank, decode(token))}
                        for token, (logprob, rank) in zip(hyp.token_ids, hyp.token_logprobs)]
            text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
            sequences.append(BeamSearchSequence(tokens, logprobs, hyp.cumulative_logprob, hyp.score, text, hyp.finish_reason))
        return BeamSearchOutput(sequences)
