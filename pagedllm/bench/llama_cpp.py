"""llama.cpp as a baseline for `pagedllm bench decode --against llama.cpp`, through
llama-cpp-python (an optional, bench-only dependency: `pip install llama-cpp-python==0.3.36`,
which compiles llama.cpp for this CPU) on the same GGUF file, with the engine's thread count.

On a CPU with AMX (Sapphire Rapids) in a VM, the default build (GGML_NATIVE) crashed in its
first decode (2026-11-26); built without AMX it runs:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python==0.3.36

Single-stream decode is timed like ours, from the first generated token to the last (greedy,
the prompt evaluated first), and prefill as the time to evaluate a prompt into an empty cache.
"""
from __future__ import annotations

import time


def load(path: str, threads: int, context: int):
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise SystemExit("--against llama.cpp needs llama-cpp-python: pip install llama-cpp-python==0.3.36 "
                         f"(it builds llama.cpp from source; {exc})") from exc
    return Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=512, verbose=False)


def decode_rate(llm, prompt: list[int], new_tokens: int) -> float:
    """Greedy tokens/s from the first generated token to the last."""
    llm.reset()
    times = []
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        if len(times) == new_tokens:
            break
    return (len(times) - 1) / (times[-1] - times[0])


def prefill_rate(llm, prompt: list[int]) -> float:
    """Prompt tokens/s of one evaluation into an empty KV cache."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)
