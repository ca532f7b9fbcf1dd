"""`LLM`: the offline entry point (vLLM's shape) — add every prompt, step until all finish."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.paths import DEFAULT_MODEL
from pagedllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.llm_engine = LLMEngine.from_engine_args(str(model or DEFAULT_MODEL), **engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_stats(self) -> dict[str, Any]:
        return self.llm_engine.get_stats()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order the prompts were given.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        ids = []
        try:
            for prompt, sp, prio in zip(prompt_list, params_list, priorities):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, sp, priority=prio)
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:  # never leave half a batch holding KV blocks
                self.llm_engine.abort_request(request_id)
            while self.llm_engine.has_unfinished_requests():
                self.llm_engine.step()
            raise

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
