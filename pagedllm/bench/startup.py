"""Start-up time and memory at rest: the engine (`LLM(model)`) and the server (`pagedllm serve`), each in a fresh process.

Each round starts a new Python process, so nothing is warm but the OS's page cache and the C
kernels' build cache (the first build of the kernels is not a start-up cost: it happens once per
machine). Reported per target: seconds from the process's start to "ready" — the engine built,
or /health answering 200 — and its resident memory at rest (VmRSS) once one short greedy request
has been served. The in-run floor is `python -c "import torch"`, which every start pays.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from pagedllm.bench.scratch import scratch_dir

# Runs in the child: import, build the engine, serve one request, report (JSON on the last line).
_ENGINE_CHILD = """
import json, sys, time
started = float(sys.argv[2])
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1] or None)
ready = time.time() - started
llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024
print(json.dumps({"ready_s": ready, "rss_bytes": rss}))
"""
_TORCH_CHILD = "import torch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per target, the best reported "
                                                                "(default: %(default)s)")
    parser.add_argument("--no-server", action="store_true", help="measure the engine only")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) * 1024


def torch_import_s() -> float:
    started = time.time()
    subprocess.run([sys.executable, "-c", _TORCH_CHILD], check=True)
    return time.time() - started


def engine_start(model: str | None, timeout: float = 600) -> dict[str, float]:
    """One fresh process: `LLM(model)` built (ready_s, from the process's start) and its RSS
    after one short greedy request (rss_bytes)."""
    started = time.time()
    done = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, model or "", repr(started)], check=True,
                          capture_output=True, text=True, timeout=timeout)
    return json.loads(done.stdout.strip().splitlines()[-1])


def server_start(model: str | None, timeout: float = 600) -> dict[str, float]:
    """One `pagedllm serve` process: seconds until /health answers 200, and its RSS after one
    short greedy chat."""
    from pagedllm.entrypoints.serve import launch

    args = [] if model is None else ["--model", model]
    log = Path(tempfile.gettempdir()) / f"pagedllm-bench-startup-{os.getpid()}.log"
    with scratch_dir("pagedllm-startup-") as data_dir:
        started = time.time()
        server = launch(["--log-level", "warning", "--data-dir", str(data_dir), *args], log, timeout=timeout)
        ready = time.time() - started
        try:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                name = http.get("/v1/models").json()["data"][0]["id"]
                http.post("/v1/chat/completions", json={"model": name, "max_tokens": 8, "temperature": 0, "messages": [
                    {"role": "user", "content": "What is the capital of France?"}]}).raise_for_status()
            return {"ready_s": ready, "rss_bytes": rss_bytes(server.proc.pid)}
        finally:
            server.stop()


def run(args: argparse.Namespace) -> int:
    load = os.getloadavg()[0]
    targets = {"engine (LLM)": lambda: engine_start(args.model)}
    if not args.no_server:
        targets["server (pagedllm serve)"] = lambda: server_start(args.model)
    engine_start(args.model)  # the C kernels' first build (once per machine) and a warm page cache
    floor = min(torch_import_s() for _ in range(args.rounds))
    best: dict[str, dict[str, float]] = {}
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for name, measure in targets.items():
            result = measure()
            if name not in best or result["ready_s"] < best[name]["ready_s"]:
                best[name] = {**result, "rss_bytes": max(result["rss_bytes"], best.get(name, {}).get("rss_bytes", 0))}
    print(f"\nstart-up, best of {args.rounds} fresh processes (load average {load:.2f} at the start):")
    floor_name = 'python -c "import torch" (the floor)'
    print(f"  {floor_name:<40} {floor:6.2f} s")
    for name, result in best.items():
        print(f"  {name:<40} {result['ready_s']:6.2f} s to ready, {result['rss_bytes'] / 2**20:7.0f} MiB resident at rest "
              "(the largest of the rounds)")
    return 0
