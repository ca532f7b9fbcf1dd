"""The default model's start-up and memory at rest (issue 44: under 5 s after the first kernel
build, under 1 GB at rest), measured as `pagedllm bench startup` measures them: a fresh process
builds `LLM()` with every default and serves one short greedy request. The time bound here is
generous (a loaded shared CI machine); the bench records the real figure (docs/benchmarks.md).
The memory bound is the issue's own: before the fixes the process held ~1.8 GB (the GGUF's Q4
matrices dequantized then dropped, kept by malloc; the whole KV pool written with zeros)."""
from __future__ import annotations

import os

from pagedllm.bench.startup import engine_start

GIB = 1 << 30


def test_the_default_model_starts_fast_and_holds_under_1_gb_at_rest():
    result = engine_start(None, timeout=300)
    load = os.getloadavg()[0]
    print(f"\n[startup] LLM() ready in {result['ready_s']:.2f} s, {result['rss_bytes'] / 2**20:.0f} MiB at rest "
          f"(load average {load:.2f})")
    assert result["rss_bytes"] < GIB, f"{result['rss_bytes'] / 2**20:.0f} MiB resident at rest"
    assert result["ready_s"] < 60, f"{result['ready_s']:.1f} s to build the engine"
