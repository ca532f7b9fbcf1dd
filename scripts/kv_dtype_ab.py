"""What a half-width KV pool (EngineConfig.kv_cache_dtype) gains in speed, on the default model.

Two engines in one process, the model's float32 pool and a `--kv` pool (float16 by default), both
with every other default (int8 activations on the GGUF's blocks), take turns on the same seeded
greedy requests, round after round, so a busier stretch of a shared machine falls on both: a
single stream as the server runs it (one step a call, outputs streamed), a single stream as
offline generate runs it (bursts of four, output returned whole), and a batch of eight. Prints
each engine's median tok/s and the median of the per-round ratios, with their range.

    .venv/bin/python scripts/kv_dtype_ab.py [--prompt-len 128] [--new-tokens 256] [--rounds 5] [--kv float16]
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.layers.kernels import cpu_model
from pagedllm.paths import default_model
from pagedllm.sampling_params import RequestOutputKind

CASES = [("batch 1, streamed", 1, RequestOutputKind.CUMULATIVE), ("batch 1, offline", 1, RequestOutputKind.FINAL_ONLY),
         ("batch 8, offline", 8, RequestOutputKind.FINAL_ONLY)]


def rate(llm: LLM, batch: int, kind: RequestOutputKind, prompt_len: int, new_tokens: int) -> float:
    prompts = [{"prompt_token_ids": [100 + (i * 37 + j * 11) % 20000 for j in range(prompt_len)]} for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, output_kind=kind)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * new_tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv", default="float16", choices=["float16", "bfloat16"])
    args = parser.parse_args()
    model = str(default_model())
    # a pool that holds every sequence of the batch at full length: no preemption on either side
    engines = {kv: LLM(model, kv_cache_dtype=kv, kv_cache_memory=1 << 30) for kv in ("auto", args.kv)}
    for llm in engines.values():
        rate(llm, 1, RequestOutputKind.FINAL_ONLY, args.prompt_len, 16)  # warm-up
    runs: dict[tuple[str, str], list[float]] = {(case, kv): [] for case, _, _ in CASES for kv in engines}
    for r in range(args.rounds):
        for case, batch, kind in CASES:
            order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
            for kv, llm in order:
                runs[(case, kv)].append(rate(llm, batch, kind, args.prompt_len, args.new_tokens))
    print(f"{cpu_model()}; prompt {args.prompt_len} tokens, {args.new_tokens} new, "
          f"{args.rounds} rounds")
    for case, _, _ in CASES:
        base, half = runs[(case, "auto")], runs[(case, args.kv)]
        ratios = [h / b for b, h in zip(base, half)]
        print(f"{case}: float32 pool {statistics.median(base):.1f}, {args.kv} pool {statistics.median(half):.1f} tok/s; "
              f"ratio median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
