"""Output processing: what a new token means for the user — text, stop rules, logprobs, outputs.

The scheduler appends each sampled token and asks `process_token` whether the sequence is done;
this module owns everything about the answer that is not KV or progress state: the incremental
detokenization and stop strings, the logprob dicts with decoded tokens, per-request timing, and
the `RequestOutput` snapshots handed to callers.
"""
from __future__ import annotations

import time
from dataclasses import replace

from pagedllm.engine.detokenizer import Detokenizer, find_stop, held_back
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.step.runner_output import SampledToken


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_generation_tokens_total = 0

    # ---- per token ---------------------------------------------------------------------------
    def process_token(self, seq: Sequence, sampled: SampledToken) -> SequenceStatus | None:
        """Record a token the scheduler has just appended; the status that ends `seq`, if any."""
        now = time.time()
        seq.cumulative_logprob += sampled.logprob
        if sampled.rank is not None:
            seq.logprobs.append(self.logprob_dict(sampled))
        self.num_generation_tokens_total += 1
        metrics = seq.request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1
        return self._check_stop(seq, sampled.token_id)

    def _check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """Stop rules in vLLM's order: EOS, stop token ids, stop strings, then length limits."""
        params = seq.request.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        delta = self.detokenizer.decode_new(seq)
        seq.output_text += delta
        if delta and params.stop_strings and seq.num_output_tokens >= params.min_tokens:
            found = find_stop(seq.output_text, len(delta), params.stop_strings)
            if found is not None:
                index, stop = found
                seq.output_text = seq.output_text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                seq.stop_reason = stop
                return SequenceStatus.FINISHED_STOPPED
        out_of_tokens = params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
        if out_of_tokens or seq.num_tokens >= self.max_model_len:
            seq.output_text += self.detokenizer.decode_new(seq, flush=True)
            return SequenceStatus.FINISHED_LENGTH
        return None

    def add_prompt_logprobs(self, request: Request, entries: list[SampledToken]) -> None:
        request.prompt_logprobs.extend(self.logprob_dict(entry) for entry in entries)

    def logprob_dict(self, sampled: SampledToken) -> dict[int, Logprob]:
        """The chosen token with its rank, then the top-N alternatives (vLLM's shape)."""
        decode = self.detokenizer.decode_token
        entry = {sampled.token_id: Logprob(sampled.logprob, sampled.rank, decode(sampled.token_id))}
        for position, (tid, value) in enumerate(sampled.top or [], start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, position, decode(tid))
        return entry

    # ---- outputs -----------------------------------------------------------------------------
    def make_output(self, request: Request) -> RequestOutput | None:
        """The request's output now; None while it runs if it asked only for its final one (or
        keeps more samples than it returns, whose best are known only at the end)."""
        params = request.params
        seqs = request.seqs
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not request.finished:
            return None
        if params.best_of > params.n:
            if not request.finished:
                return None  # the best n are only known at the end
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        return self._snapshot(request, [_completion(seq, index) for index, seq in enumerate(seqs)])

    def _snapshot(self, request: Request, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            metrics=request.metrics,
            prompt_logprobs=request.prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            status=request.state.value,
            num_preemptions=request.num_preemptions,
        )

    def failed_output(self, request: Request) -> RequestOutput:
        """The final output of a request the engine failed: every sample ends with reason "error"."""
        completions = [replace(_completion(seq, index), finish_reason="error", stop_reason=request.error)
                       for index, seq in enumerate(request.seqs[: request.params.n])]
        return replace(self._snapshot(request, completions), finished=True)


def _completion(seq: Sequence, index: int) -> CompletionOutput:
    text = seq.output_text
    stops = seq.request.params.stop_strings
    if stops and not seq.finished:
        text = text[: len(text) - held_back(text, stops)]
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=list(seq.logprobs) if seq.request.params.logprobs is not None else None,
        finish_reason=seq.finish_reason(),
        stop_reason=seq.stop_reason,
    )
