"""Online serving: N concurrent streaming clients against an OpenAI-compatible server.

Each request is a random token-id prompt of --input-len tokens asking for exactly --output-len
tokens (ignore_eos), sent as a streaming /v1/completions call; at most --concurrency are in
flight at once (a closed loop: a client sends its next request when the previous one ends).
Reports request throughput, output tokens/s, time to first token (TTFT), inter-token latency
(ITL: gaps between streamed chunks; a chunk may carry several tokens when the client reads
slower than the engine steps) and time per output token (TPOT: (e2e - TTFT) / (tokens - 1)).

    pagedllm bench serve --url http://127.0.0.1:8000 --model tiny
    pagedllm bench serve --model-path DIR --num-kv-blocks 2048     # starts its own server
    pagedllm bench serve --model-path DIR --data-parallel-size 2   # one engine, then 2 replicas, same run

With --data-parallel-size N (and --model-path) the same load runs twice, against a server with one
engine (torch's threads: all cores) and against one with N replica processes (the cores split between
them), and the two summaries are printed side by side with their ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pagedllm.bench.scratch import scratch_dir


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class Summary:
    num_requests: int
    failed: int
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": 1000 * statistics.fmean(ordered), "p50": 1000 * pick(0.5), "p99": 1000 * pick(0.99)}


async def one_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    start = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc))
    if first is None:
        return RequestResult(False, error="no chunk received")
    return RequestResult(True, first - start, time.perf_counter() - start, tokens, gaps)


async def run_load(args: argparse.Namespace, base_url: str, model: str | None) -> tuple[Summary, list[RequestResult]]:
    rng = random.Random(args.seed)
    bodies = [
        {
            "prompt": [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)],
            "max_tokens": args.output_len, "ignore_eos": True, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True},
            **({"model": model} if model else {}),
        }
        for _ in range(args.num_requests)
    ]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        warm = await one_request(client, {**bodies[0], "max_tokens": 2})
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        queue = list(bodies)
        results: list[RequestResult] = []

        async def worker() -> None:
            while queue:
                results.append(await one_request(client, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        duration = time.perf_counter() - start
    return summarize(results, duration, args.input_len), results


def summarize(results: list[RequestResult], duration: float, input_len: int) -> Summary:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return Summary(
        num_requests=len(results),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_tokens_per_s=out_tokens / duration,
        total_tokens_per_s=(out_tokens + input_len * len(ok)) / duration,
        ttft_ms=percentiles([r.ttft for r in ok]),
        itl_ms=percentiles([g for r in ok for g in r.chunk_gaps]),
        tpot_ms=percentiles([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        e2e_ms=percentiles([r.e2e for r in ok]),
    )


def report(summary: Summary, args: argparse.Namespace) -> str:
    lines = [
        f"requests: {summary.num_requests} ({summary.failed} failed), concurrency {args.concurrency}, "
        f"input {args.input_len} tokens, output {args.output_len} tokens",
        f"duration: {summary.duration_s:.2f} s",
        f"request throughput: {summary.request_throughput:.2f} req/s",
        f"output tokens/s: {summary.output_tokens_per_s:.1f}   (prompt + output: {summary.total_tokens_per_s:.1f})",
    ]
    for name, stats in (("TTFT", summary.ttft_ms), ("ITL", summary.itl_ms), ("TPOT", summary.tpot_ms), ("E2E", summary.e2e_ms)):
        lines.append(f"{name:5s} ms: mean {stats['mean']:8.1f}  p50 {stats['p50']:8.1f}  p99 {stats['p99']:8.1f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model-path", help="start `pagedllm serve --model MODEL_PATH` for the run")
    parser.add_argument("--model", help="served model name (default: the server's only model)")
    parser.add_argument("--api-key", help="the server's API key, sent as a bearer token")
    parser.add_argument("--num-requests", type=int, default=64, help='requests in all (default: %(default)s)')
    parser.add_argument("--concurrency", type=int, default=16, help='requests in flight at once (default: %(default)s)')
    parser.add_argument("--input-len", type=int, default=128, help='prompt tokens per request (default: %(default)s)')
    parser.add_argument("--output-len", type=int, default=64, help='tokens generated per request (default: %(default)s)')
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below it (default: ask the server)")
    parser.add_argument("--temperature", type=float, default=0.0, help='sampling temperature (default: %(default)s)')
    parser.add_argument("--seed", type=int, default=0, help="prompts' and sampling seed (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help='seconds one request may take (default: %(default)s)')
    parser.add_argument("--output-json", help="also write the summary here")
    parser.add_argument("--serve-arg", action="append", default=[], help="with --model-path: extra `pagedllm serve` flag (repeat)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="with --model-path: run one engine, then this many replicas, and compare (default 1: one run)")


def _vocab_size(base_url: str, args: argparse.Namespace) -> int:
    if args.vocab_size:
        return args.vocab_size
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx.get(base_url + "/tokenizer_info", params={"model": args.model} if args.model else {}, headers=headers)
    if response.status_code != 200:
        raise SystemExit(f"cannot ask the server for its vocabulary ({response.text[:200]}); pass --vocab-size")
    return response.json()["vocab_size"]


def run(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        return compare_data_parallel(args)
    summary, results = measure(args, [])
    print(report(summary, args))
    return finish(args, {"summary": asdict(summary)}, results)


def measure(args: argparse.Namespace, serve_args: list[str]) -> tuple[Summary, list[RequestResult]]:
    """The load against --url, or against a server of its own started with `serve_args` added."""
    if not args.model_path:
        return _load(args, args.url.rstrip("/").removesuffix("/v1"))
    from pagedllm.entrypoints.serve import launch

    # the server's folder is kept (with its log) only when the run fails
    with scratch_dir("pagedllm-bench-", keep_failed=True) as scratch:
        log = scratch / "server.log"
        extra = [arg for item in args.serve_arg for arg in item.split()] + serve_args
        print(f"starting pagedllm serve --model {args.model_path} {' '.join(extra)} (log: {log})", file=sys.stderr)
        # its own (empty) training job store: a benchmark must not touch the user's
        server = launch(["--model", args.model_path, "--log-level", "warning", "--data-dir", str(scratch / "data"), *extra], log)
        try:
            return _load(args, server.url)
        finally:
            server.stop()


def _load(args: argparse.Namespace, base_url: str) -> tuple[Summary, list[RequestResult]]:
    args.vocab_size = _vocab_size(base_url, args)
    return asyncio.run(run_load(args, base_url, args.model))


def compare_data_parallel(args: argparse.Namespace) -> int:
    """One engine, then --data-parallel-size replicas, the same load against each, one after the other."""
    if not args.model_path:
        raise SystemExit("bench serve --data-parallel-size needs --model-path (it starts both servers)")
    size = args.data_parallel_size
    one, one_results = measure(args, [])
    many, many_results = measure(args, ["--data-parallel-size", str(size)])
    print(f"== one engine\n{report(one, args)}\n== {size} replicas\n{report(many, args)}")
    print(f"{size} replicas / one engine: output tokens/s x{many.output_tokens_per_s / one.output_tokens_per_s:.2f}, "
          f"TTFT p50 x{many.ttft_ms['p50'] / max(one.ttft_ms['p50'], 1e-9):.2f}, "
          f"TPOT p50 x{many.tpot_ms['p50'] / max(one.tpot_ms['p50'], 1e-9):.2f}")
    return finish(args, {"one_engine": asdict(one), f"replicas_{size}": asdict(many)}, one_results + many_results)


def finish(args: argparse.Namespace, summaries: dict, results: list[RequestResult]) -> int:
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"settings": vars(args), **summaries}, indent=2, default=str))
    return 1 if errors else 0
