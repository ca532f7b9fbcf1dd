"""Beam search: which continuations survive a step, which become finished hypotheses, and when
the search is over — by transformers' `num_beams` rules, so results equal its `generate`.

Each live beam is an ordinary sequence to the scheduler (it decodes one token per step with its
own block table); the only coupling is here. Once every live beam of a request has its next-token
distribution (the top-K logprobs of its row), `BeamSearch.step` ranks all beam × token
continuations by cumulative logprob and keeps the best K = max(2, 1 + #EOS) × width of them:

- among the best `width`, those that end on EOS (or reach `max_tokens`) become hypotheses,
  scored cumulative logprob / generated length ** length_penalty; the best `width` are kept;
- the best `width` that did not end become next step's beams (a beam picked several times is
  forked: its blocks are shared and copied only when written);
- the search ends when no continuation can go on, or when all `width` hypothesis slots are full
  and the best running beam, at its current length, cannot beat the worst of them (transformers'
  default `early_stopping=False` heuristic).

K > width keeps `width` beams alive even when the best continuations all end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.sequence import Sequence
from pagedllm.sampling_params import BeamSearchParams


@dataclass
class BeamState:
    """A beam's part of the search: its output tokens' (logprob, rank) and, once its row was
    computed this round, its top-K next tokens as (token, logprob), best first."""

    token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    candidates: list[tuple[int, float]] | None = None

    def fork(self) -> "BeamState":
        return BeamState(list(self.token_logprobs))


@dataclass
class Continuation:
    parent: Sequence
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
    """One request's search state, owned by the scheduler."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int], max_new_tokens: int):
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.max_new_tokens = max_new_tokens
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * self.width
        self.num_generated = 0
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.done = False

    def step(self, beams: list[Sequence]) -> list[Continuation]:
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

    def _rank(self, beams: list[Sequence]) -> list[Continuation]:
        conts = []
        for seq in beams:
            for rank, (token, logprob) in enumerate(seq.beam.candidates, start=1):
                conts.append(Continuation(seq, token, logprob, rank, seq.cumulative_logprob + logprob))
        conts.sort(key=lambda c: c.score, reverse=True)  # stable: ties keep beam, then token rank order
        return conts[: self.num_candidates]

    def _add_hypothesis(self, cont: Continuation, length: int) -> None:
        parent = cont.parent
        hypothesis = Hypothesis(
            token_ids=parent.output_token_ids + [cont.token_id],
            token_logprobs=parent.beam.token_logprobs + [(cont.logprob, cont.rank)],
            cumulative_logprob=cont.score,
            score=beam_score(cont.score, length, self.length_penalty),
            finish_reason="stop" if cont.token_id in self.eos_token_ids else "length",
        )
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def _improvable(self, best: Continuation) -> bool:
        """Could the best running beam still beat the worst kept hypothesis? Judged at the
        current length, as transformers' default heuristic does."""
        if len(self.finished) < self.width:
            return True
        return beam_score(best.score, self.num_generated, self.length_penalty) > self.finished[-1].score
