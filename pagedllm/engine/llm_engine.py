"""LLMEngine: seed 001's Engine API over the scheduler, block manager and model runner.

One `step()` = schedule → (fork samples whose prompt just completed) → one forward pass →
sample → append tokens, check stop conditions, detokenize → free what finished. Bad input is
rejected in `add_request` with a ValueError before anything is queued, so one bad request never
disturbs the others.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Union

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.detokenizer import Detokenizer, find_stop, held_back
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus
from pagedllm.layers.sampler import SampleResult
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner, SampleRequest, StepResult

PromptType = Union[str, list[int], dict[str, Any]]
MAX_LOGPROBS = 20


def load_tokenizer(path: str):
    """transformers' fast tokenizer (tokenizer.json + tokenizer_config.json), or None when the
    folder ships none: token-id prompts still work then."""
    folder = Path(path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        max_batched = config.resolve_max_num_batched_tokens(self.max_model_len)
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, self.runner.num_cpu_blocks, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
                preemption_policy=config.preemption_policy,
            ),
            self.block_manager,
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    @classmethod
    def from_engine_args(cls, model: str, **engine_args: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            eos_token_ids=self.eos_token_ids,
        )
        seq = Sequence(request, 0, list(token_ids), request.new_generator(0, self.runner.device))
        request.seqs.append(seq)
        self.detokenizer.start(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer; pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, _token_list(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        if len(token_ids) + 1 > pool_tokens:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than the whole KV cache holds "
                f"({pool_tokens} tokens in {self.block_manager.num_blocks} blocks)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name}={value} exceeds the maximum of {MAX_LOGPROBS}")

    def abort_request(self, request_id: str) -> None:
        """Cancel a request wherever it is; its KV blocks are freed now. Unknown ids: no-op.

        The next `step()` reports it once more, finished with finish_reason "abort"."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.set_status(SequenceStatus.FINISHED_ABORTED)
        request.metrics.finished_time = time.time()
        self._aborted.append(request)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched: dict[str, Request] = {r.request_id: r for r in self._aborted}
        self._aborted = []
        sched = self.scheduler.schedule()
        now = time.time()
        for seq in sched.ended:
            touched[seq.request.request_id] = seq.request
        if not sched.is_empty:
            sample_requests = self._sample_requests(sched)
            tables = {s.seq.seq_id: self.block_manager.block_table(s.seq.seq_id) for s in sched.scheduled}
            result = self.runner.execute(sched, tables, sample_requests)
            self._advance(sched, now)
            self._record_prompt_logprobs(result)
            self._apply_samples(result.samples, time.time())
            for item in sched.scheduled:
                touched[item.seq.request.request_id] = item.seq.request
        outputs = []
        for request in touched.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
                request.metrics.finished_time = request.metrics.finished_time or time.time()
            output = self._make_output(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def _sample_requests(self, sched: SchedulerOutput) -> list[SampleRequest]:
        """Which sequences get a token this step, forking the extra samples of a request whose
        prompt completes now: they share its blocks and sample from the same logits row."""
        plan = []
        for item in sched.scheduled:
            if not item.completes_context:
                continue
            seq, request = item.seq, item.seq.request
            plan.append(SampleRequest(seq, seq))
            if request.forked or request.params.best_of == 1:
                continue
            request.forked = True
            for index in range(1, request.params.best_of):
                child = Sequence(request, index, list(seq.token_ids), request.new_generator(index, self.runner.device))
                child.num_computed_tokens = seq.num_computed_tokens + item.num_new_tokens
                child.set_status(SequenceStatus.RUNNING)
                self.block_manager.fork(seq.seq_id, child.seq_id)
                self.detokenizer.start(child)
                request.seqs.append(child)
                self.scheduler.add_running(child)
                plan.append(SampleRequest(child, seq))
        return plan

    def _advance(self, sched: SchedulerOutput, now: float) -> None:
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
                self.num_prompt_tokens_total += len(seq.request.prompt_token_ids)

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        for seq, entries in result.prompt_logprobs.items():
            for logprob, rank, token, top in entries:
                seq.request.prompt_logprobs.append(self._logprob_dict(token, logprob, rank, top))

    def _logprob_dict(self, token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        entry = {token: Logprob(logprob, rank, self.detokenizer.decode_token(token))}
        for position, (tid, value) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, position, self.detokenizer.decode_token(tid))
        return entry

    def _apply_samples(self, samples: list[tuple[Sequence, SampleResult]], now: float) -> None:
        for seq, sample in samples:
            if seq.finished:
                continue
            seq.token_ids.append(sample.token_id)
            seq.cumulative_logprob += sample.logprob
            if sample.rank is not None:
                seq.logprobs.append(self._logprob_dict(sample.token_id, sample.logprob, sample.rank, sample.top))
            self.num_generation_tokens_total += 1
            metrics = seq.request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.num_generation_tokens += 1
            status = self._check_stop(seq, sample.token_id)
            if status is not None:
                seq.set_status(status)
                self.scheduler.remove(seq)

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

    # ---- outputs -----------------------------------------------------------------------------
    def _make_output(self, request: Request) -> RequestOutput | None:
        params = request.params
        seqs = request.seqs
        if params.best_of > params.n:
            if not request.finished:
                return None  # the best n are only known at the end
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        completions = [self._completion(seq, index) for index, seq in enumerate(seqs)]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            metrics=request.metrics,
            prompt_logprobs=request.prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
        )

    @staticmethod
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

    # ---- stats -------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        bm, sched = self.block_manager, self.scheduler
        requests_in = lambda queue: len({s.request.request_id for s in queue})  # noqa: E731
        return {
            "num_preemptions": sched.num_preemptions,
            "num_swap_outs": sched.num_swap_outs,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "num_free_cpu_blocks": bm.num_free_cpu_blocks,
            "num_total_cpu_blocks": bm.num_cpu_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
            "num_running": requests_in(sched.running),
            "num_waiting": requests_in(sched.waiting),
            "num_swapped": requests_in(sched.swapped),
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
        }


def _token_list(values: Any) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise ValueError("prompt token ids must be a list of integers")
    return list(values)
