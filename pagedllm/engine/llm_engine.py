"""LLMEngine: the Engine API (add_request, abort_request, step, stats) over the scheduler, the
model runner and the output processor.

One `step()` = `scheduler.schedule()` → `runner.execute()` (one forward pass, sampling) →
`scheduler.update_from_output()` (progress, tokens, stop rules, freeing) → `RequestOutput`s.
With async scheduling a step is launched, the previous step's output taken back while the device
runs it, and the step itself left in flight when it qualifies (engine/scheduler.py): its outputs
come with the next `step()`.
The engine itself changes no request or KV state; it builds the pieces, with the planner that
decides how steps run (step/planner.py) shared by the scheduler and the runner. Bad input is rejected in `add_request` with a
ValueError before anything is queued, so one bad request never disturbs the others.
"""
from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path
from typing import Any, Union

import torch

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus
from pagedllm.gguf import is_gguf, open_gguf
from pagedllm.lora.request import LoRARequest
from pagedllm.gguf.tokenizer import gguf_tokenizer
from pagedllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.step.planner import StepPlanner
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.step_results import StepResults

logger = logging.getLogger("pagedllm.engine")
PromptType = Union[str, list[int], dict[str, Any]]
MAX_LOGPROBS = 20
# Failed steps in a row after which the engine, not a request, is taken to be broken (`step`)
MAX_FAILED_STEPS = 4


def load_tokenizer(path: str):
    """transformers' fast tokenizer (tokenizer.json + tokenizer_config.json, or a GGUF file's
    metadata), or None when the folder ships none: token-id prompts still work then."""
    if is_gguf(path):
        return gguf_tokenizer(open_gguf(path))
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
        self.planner = StepPlanner.decide(config, self.model_config, self.max_model_len)
        self.runner = _make_runner(config, self.model_config, self.max_model_len, self.planner)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size) if self.tokenizer else None
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, self.runner.num_cpu_blocks, config.enable_prefix_caching,
            secure=config.secure_kv_blocks,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
                preemption_policy=config.preemption_policy,
                max_step_blocks=self.runner.max_step_blocks,
                watermark=config.watermark,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_loras=config.max_loras if config.enable_lora else 0,
            ),
            self.block_manager,
            self.structured,
            self.planner,
        )
        self.eos_token_ids = self._eos_token_ids()
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._in_flight: StepResults | None = None  # async scheduling: the step whose output is still out
        self._failed_steps = 0  # steps in a row that raised (`step`)

    @property
    def device(self) -> torch.device:
        return self.runner.device

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; with `lora_request`, generated with that adapter (loaded and
        validated here, so a bad adapter is a ValueError naming why before anything is queued).
        (A beam search is a layer over the engine: engine/beam_search.py.)"""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__} "
                             "(beam search: LLM.beam_search, or engine/beam_search.py's BeamSearcher)")
        text, token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            lora_request=lora_request,
        )
        seq = Sequence(request, 0, list(token_ids))
        if params.structured_outputs is not None:
            seq.grammar = self._matcher(params)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    # ---- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and validate an adapter into the host cache (vLLM's add_lora); a LoRAError
        (a ValueError) says why it cannot be served."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine was started without enable_lora=True")
        self.runner.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from memory (running requests that use it reload it from their path)."""
        return self.runner.lora.remove(lora_int_id) if self.runner.lora is not None else False

    def _matcher(self, params: SamplingParams):
        if self.structured is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer; structured_outputs need one")
        return self.structured.matcher(params.structured_outputs)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: text, token ids, or a dict with either."""
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

    def _check_prompt_ids(self, token_ids: list[int]) -> None:
        """Every prompt's rule (generating or embedding): not empty, every id in the vocabulary."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self._check_prompt_ids(token_ids)
        vocab = self.model_config.vocab_size
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one generated token)"
            )
        capacity = self.scheduler.capacity_blocks
        pool_tokens = capacity * self.block_manager.block_size
        if len(token_ids) + 1 > pool_tokens:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than the whole KV cache holds "
                f"({pool_tokens} tokens in {capacity} blocks)"
            )
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids or ())):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name}={value} exceeds the maximum of {MAX_LOGPROBS}")
        if params.best_of > self.config.max_num_seqs:  # its samples could never run at once
            name = "best_of" if params.best_of != params.n else "n"
            raise ValueError(f"{name}={params.best_of} exceeds max_num_seqs={self.config.max_num_seqs}")

    def embed(self, prompts: list[PromptType], normalize: bool = True,
              request_ids: list[str] | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (last-token pooling of the final norm's output, L2-normalized
        unless `normalize` is False; worker/pooler.py), computed now, in forward passes of at most
        max_num_batched_tokens tokens that leave the KV pool and the running requests as they
        were. Every prompt is checked before any is run: a bad one is a ValueError naming it."""
        if self.planner.tensor_parallel_size > 1:
            raise ValueError("embeddings are not computed under tensor parallelism (tensor_parallel_size > 1)")
        token_lists = []
        for index, prompt in enumerate(prompts):
            try:
                token_lists.append(self._embedding_tokens(prompt))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}" if len(prompts) > 1 else str(exc)) from exc
        budget = self.config.resolve_max_num_batched_tokens(self.max_model_len)
        vectors = self.runner.embed(token_lists, budget, normalize)
        ids = request_ids or [f"embd-{i}" for i in range(len(prompts))]
        return [EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), tokens)
                for request_id, vector, tokens in zip(ids, vectors, token_lists)]

    def _embedding_tokens(self, prompt: PromptType) -> list[int]:
        """An embedding prompt's token ids: not empty, in the vocabulary, at most max_model_len
        (no room for a generated token is needed)."""
        _, token_ids = self.tokenize(prompt)
        self._check_prompt_ids(token_ids)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}")
        return token_ids

    def abort_request(self, request_id: str) -> None:
        """Cancel a request wherever it is; its KV blocks are freed now. Unknown ids: no-op.

        The next `step()` reports it once more, finished with finish_reason "abort"."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        request.metrics.finished_time = time.time()
        self._aborted.append(request)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache's blocks (vLLM's API); False while requests hold blocks."""
        return self.scheduler.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release what outlives the engine's objects: tensor-parallel worker processes. (They
        also go when this process ends, however it ends.)"""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def fail_unfinished(self, error: str) -> list[RequestOutput]:
        """After the engine itself failed (an exception out of `step`): every unfinished request
        is marked failed, its KV blocks freed, and its final output finishes with reason "error".
        Nothing else of the engine is trusted afterwards; whoever owns it shuts it down."""
        self._in_flight = None
        self._aborted = []
        return self._fail_requests(list(self.requests.values()), error)

    def _fail_requests(self, requests: list[Request], error: str) -> list[RequestOutput]:
        """End `requests` now, KV blocks freed, each sample finishing with reason "error"."""
        outputs = []
        for request in requests:
            self.requests.pop(request.request_id, None)
            for seq in request.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            request.error = error
            request.metrics.finished_time = time.time()
            outputs.append(self.output_processor.failed_output(request))
        return outputs

    def request_states(self) -> list[dict[str, Any]]:
        """Every live request's state, timings (time.time()) and counts: what the platform's
        data model keeps per InferenceRequest."""
        rows = []
        for request in self.requests.values():
            m = request.metrics
            rows.append({
                "id": request.request_id, "status": request.state.value, "priority": request.priority,
                "arrival_time": m.arrival_time, "first_scheduled_time": m.first_scheduled_time,
                "first_token_time": m.first_token_time, "num_prompt_tokens": len(request.prompt_token_ids),
                "num_generated_tokens": sum(seq.num_output_tokens - seq.num_pending for seq in request.seqs),
                "num_samples": len(request.seqs), "num_preemptions": request.num_preemptions,
            })
        return rows

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted) or self._in_flight is not None

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A step that raises ends the requests it was computing (finish reason
        "error", the cause logged) and nothing else: the others go on at the next step. Only
        when MAX_FAILED_STEPS steps in a row fail — the engine, not a request, is broken — does
        the exception leave `step`, and the engine's owner fails what is left."""
        touched: dict[str, Request] = {r.request_id: r for r in self._aborted}
        self._aborted = []
        try:
            self._step(touched)
        except Exception as exc:
            failed = self._recover(exc, touched)
            return failed + self._outputs(touched)
        self._failed_steps = 0
        return self._outputs(touched)

    def _recover(self, exc: Exception, touched: dict[str, Request]) -> list[RequestOutput]:
        """Give up the steps in flight and end the requests they computed; see `step`."""
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            logger.error("%d engine steps in a row failed; the engine is broken", self._failed_steps)
            raise exc
        if self.planner.tensor_parallel_size > 1:
            raise exc  # the ranks' collectives are out of step: the group cannot go on
        self._in_flight = None
        self.runner.abandon_steps()
        victims, ended = self.scheduler.abandon_steps()
        for seq in ended:
            touched[seq.request.request_id] = seq.request
        requests = {seq.request.request_id: seq.request for seq in victims}
        logger.error("an engine step failed; ending the %d request(s) it computed (%s) with finish reason 'error':\n%s",
                     len(requests), ", ".join(sorted(requests)), "".join(traceback.format_exception(exc)).rstrip())
        for request_id in requests:
            touched.pop(request_id, None)
        return self._fail_requests(list(requests.values()), f"the engine step computing this request failed: {exc!r}")

    def _step(self, touched: dict[str, Request]) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and not self.scheduler.can_schedule_ahead():
            self._take_back(in_flight.result(), touched)
            in_flight = None
        sched = self.scheduler.schedule()
        if not self.planner.async_scheduling:
            self._take_back(self.runner.execute(sched), touched)
            return
        launched = self.runner.launch(sched)
        if in_flight is not None:  # the host's share of the last step while the device runs this one
            self._take_back(in_flight.result(), touched)
        if self.scheduler.defer_last():
            self._in_flight = launched
        else:
            self._take_back(launched.result(), touched)

    def _take_back(self, output, touched: dict[str, Request]) -> None:
        """A step's output into the requests: prompt logprobs, tokens, progress, stop rules."""
        for seq_id, entries in output.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(self.scheduler.live[seq_id].request, entries)
        for seq in self.scheduler.update_from_output(output, self.output_processor.process_token):
            touched[seq.request.request_id] = seq.request

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
                request.metrics.finished_time = request.metrics.finished_time or time.time()
            snapshot = self.output_processor.make_output(request)
            if snapshot is not None:
                outputs.append(snapshot)
        return outputs

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
            "prompt_tokens_total": sched.num_prompt_tokens_total,
            "generation_tokens_total": self.output_processor.num_generation_tokens_total,
            **self._spec_decode_stats(),
        }

    def _spec_decode_stats(self) -> dict[str, Any]:
        """vLLM's spec_decode counters, plus the derived rates and where the time went."""
        speculator = self.runner.speculator
        if speculator is None:
            return {}
        return self.scheduler.spec_stats.report(speculator.draft_time_s, speculator.target_time_s)


def _make_runner(config: EngineConfig, model_config: ModelConfig, max_model_len: int, planner: StepPlanner):
    """One runner, with the speculator when the engine speculates; or rank 0's runner and the
    tensor-parallel workers (which do not speculate)."""
    if planner.tensor_parallel_size > 1:
        from pagedllm.worker.tensor_parallel import TensorParallelRunner

        return TensorParallelRunner(config, model_config, max_model_len, planner)
    speculator = None
    if planner.speculation is not None:
        speculator = Speculator(planner, model_config, max_model_len, config.block_size, config.torch_dtype(model_config),
                                config.torch_device())
    return ModelRunner(config, model_config, max_model_len, planner=planner, speculator=speculator)


def _token_list(values: Any) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise ValueError("prompt token ids must be a list of integers")
    return list(values)
