"""`LLM`: the offline entry point (vLLM's shape) — add every prompt, step until all finish."""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from pagedllm.engine.beam_search import BeamSearcher
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.entrypoints.chat_template import render_chat
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import BeamSearchOutput, EmbeddingRequestOutput, RequestOutput
from pagedllm.paths import default_model
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        """`model`: a Hugging Face model folder or a GGUF file; the default model
        (SmolLM2-135M-Instruct, paths.py) when None."""
        self.llm_engine = LLMEngine.from_engine_args(str(model or default_model()), **engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict[str, Any]:
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt blocks (vLLM's `LLM.reset_prefix_cache`): the next run of the
        same prompts computes them again. False, and nothing dropped, while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order the prompts were given.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}. `lora_request`
        (engine started with enable_lora=True): one adapter for every prompt, or one per prompt
        (None: the base model), as vLLM's LLM takes it."""
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompt_list)} prompts")
        return self._add_and_run(prompt_list, params_list, priorities, use_tqdm, loras)

    def chat(
        self,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, str]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or several, each rendered by
        the model's chat template (or `chat_template`) as the server's chat endpoint renders it,
        then generated like `generate`'s prompts."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = render_chat(tokenizer, list(conversation), tools=tools, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                               documents=documents, chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: PromptType | Seq[PromptType], normalize: bool = True) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding, in the prompts' order — the last token's
        hidden state after the final norm, L2-normalized unless `normalize` is False (vLLM's
        default pooling for a decoder model without a pooler config; docs/serving.md). A prompt
        is a string, a list of token ids, or {"prompt_token_ids": [...]}; the whole prompt
        counts, up to max_model_len tokens."""
        prompt_list = _as_prompt_list(prompts)
        ids = [f"embd-{next(self._counter)}" for _ in prompt_list]
        return self.llm_engine.embed(prompt_list, normalize, request_ids=ids)

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's `LLM.beam_search`): each prompt's `beam_width`
        best hypotheses, best first. The searches run over the engine's ordinary requests, one
        one-token request per beam and round, sharing KV through the prefix cache
        (engine/beam_search.py).

        The rounds are stepped on a worker thread, as the server's engine loop steps them: a
        round's step interleaves torch ops and the C kernels, both OpenMP, and on the main
        thread their waiters spun against each other on a shared machine — the same search took
        8.5-9.9 s there against 1.0-1.2 s on another thread (SmolLM2, width 4, 16 tokens, load
        average ~5; `OMP_WAIT_POLICY=PASSIVE` gave 1.6 s). `pagedllm bench beam` compares it
        with the server's. The caller waits; nothing else touches the engine meanwhile."""
        searcher, prompt_list = BeamSearcher(self.llm_engine), _as_prompt_list(prompts)
        ids = [f"beam-{next(self._counter)}" for _ in prompt_list]
        bar = tqdm(total=len(ids), desc="Beam searches", unit="prompt", disable=not use_tqdm, dynamic_ncols=True)
        stop = threading.Event()  # set when the caller gives up (e.g. Ctrl-C): the worker aborts

        def search() -> None:
            try:
                for search_id, prompt in zip(ids, prompt_list):
                    searcher.add(search_id, prompt, params)
                while searcher.has_unfinished():
                    if stop.is_set():
                        raise KeyboardInterrupt("beam search interrupted")
                    searcher.step()
                    bar.update(len(searcher.results) - bar.n)
            except BaseException:
                for search_id in ids:  # never leave a search holding KV blocks
                    searcher.abort(search_id)
                self._drain()
                raise

        worker = ThreadPoolExecutor(1, "pagedllm-beam-search")
        try:
            worker.submit(search).result()
        except BaseException:
            stop.set()
            raise
        finally:
            worker.shutdown(wait=True)
            bar.close()
        return [searcher.results[search_id] for search_id in ids]

    def _add_and_run(self, prompt_list: list[PromptType], params_list: list, priorities: list[int], use_tqdm: bool,
                     loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        ids = []
        loras = loras or [None] * len(prompt_list)
        try:
            for prompt, sp, prio, lora in zip(prompt_list, params_list, priorities, loras):
                request_id = str(next(self._counter))
                if isinstance(sp, SamplingParams):  # only finished outputs are returned (vLLM's LLM does the same)
                    sp = replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, sp, priority=prio, lora_request=lora)
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:  # never leave half a batch holding KV blocks
                self.llm_engine.abort_request(request_id)
            self._drain()
            raise

    def _drain(self) -> None:
        """Step until aborted requests have been reported (and their blocks freed)."""
        while self.llm_engine.has_unfinished_requests():
            self.llm_engine.step()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, tokens = time.perf_counter(), 0
        wanted = set(ids)
        while len(finished) < len(ids):
            for output in self.llm_engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
                    tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")
        bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)
