"""Decode speed at batch 1 and 8 against the memory's read bandwidth, measured in the same run.

A decode step of a few sequences must read every weight once and each sequence's K/V, so its
speed limit is the read bandwidth divided by those bytes (the K/V at a sequence's mean context,
in the engine's KV dtype: at batch 8 and ~160 tokens, fp32 K/V is 60 % of the weights' bytes). This benchmark measures that bandwidth
(a STREAM-like read of a buffer much larger than the last-level cache, with the engine's
threads), the bytes of weights the engine reads per step (fp32 or int8 with its scales), and
decode tok/s on a random model with SmolLM2-135M's shape: a 128-token prompt, 128 greedy tokens,
the rate taken from the first to the last token (so prefill is not counted). pagedllm runs with
one greedy step per engine step and with several (multi-step scheduling), and transformers'
`generate` runs the same requests in the same process as the baseline.

A batch of B rows also does 2 x B x (weights' elements) operations a step, which at batch 8 on a
2-core CPU can take longer than reading the weights; so each batch's limit is the lower of the
bandwidth limit and the arithmetic peak over that work, the peak measured in the same run in the
dtype the engine computes in (matmul_peak.measure_cpu_peak: fp32 FMAs, or the int8 dot products
of int8 activations — an fp32 peak set against int8 work once printed shares of 172 %).

`--model FILE.gguf --against llama.cpp` runs a real GGUF file instead (its blocks kept, as the
engine serves it by default) against llama.cpp on the same file through llama-cpp-python (an
optional, bench-only dependency, bench/llama_cpp.py) with the same thread count: single-stream
decode (first to last token, the engines taking turns) and a 512-token prefill.

`--temperature T` (with `--top-k`, `--top-p`, `--min-p`) samples instead: every engine with the
same temperature and filters (a chat client's request), each by its own sampler — pagedllm's
in its fused call, llama.cpp's sampler chain, transformers' logits warpers — seeded by `--seed`.

The read bandwidth of a shared VM is not a constant: other tenants of the host take a share of
the memory system that changes from one second to the next (1 GiB reads of the same buffer a few
seconds apart have given 38 and 77 GB/s). A limit from the best bandwidth seen at any moment of
the run, set against a decode run taken at another moment, mixes two machines. So every timed
run is bracketed by two bandwidth reads and its share is taken against the higher of the two —
the machine as fast as it was around that run; the table gives the median of those paired
shares next to the share of the best rate against the best bandwidth of the whole run. The
engines take turns, one run each per round, so a busier stretch falls on all of them alike.
"""
from __future__ import annotations

import argparse
import functools
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagedllm.bench.engine_args import parse_engine_args
from pagedllm.bench.offline import SMOLLM2_135M, build_model
from pagedllm.layers import kernels
from pagedllm.matmul_peak import measure_cpu_peak


@functools.cache
def _read_buffer(size_bytes: int) -> torch.Tensor:
    """Allocated and touched once: the bandwidth is read before and after every timed run."""
    return torch.ones(size_bytes // 4)


def read_bandwidth(repeats: int = 5, size_bytes: int = 1 << 30) -> float:
    """Bytes/s of a read of `size_bytes` (32x an L3 of 32 MiB) with torch's thread count: the
    kernel library's vector read, or torch's sum without a compiler."""
    buffer = _read_buffer(size_bytes)
    library = kernels.load()
    if library is not None:
        return library.read_bandwidth(buffer.data_ptr(), buffer.numel(), repeats, torch.get_num_threads())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return size_bytes / best


@dataclass
class Rate:
    tok_s: float  # decode tokens/s over all sequences, first to last token

    def __str__(self) -> str:
        return f"{self.tok_s:7.1f}"


@dataclass(frozen=True)
class Sampling:
    """How every engine of the run picks its tokens: greedy (temperature 0), or sampled with the
    same temperature, top-k (-1: off), top-p and min-p — a chat client's request rather than the
    parity tests' — each engine by its own sampler and random numbers (seeded), so the tokens
    differ while the work a token does not."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def params(self, new_tokens: int, seed: int):
        """pagedllm's SamplingParams: `new_tokens` tokens whatever is sampled (no EOS)."""
        from pagedllm import SamplingParams

        if self.greedy:
            return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=seed,
                              max_tokens=new_tokens, ignore_eos=True)

    def llama_cpp(self) -> dict:
        """llama-cpp-python's generate() arguments (top_k 0: off; its chain filters before the
        temperature, ours after: the same filters, a slightly different distribution)."""
        if self.greedy:
            return {"temp": 0.0, "top_k": 1}
        return {"temp": self.temperature, "top_k": max(self.top_k, 0), "top_p": self.top_p, "min_p": self.min_p}

    def transformers(self) -> dict:
        """transformers' generate() arguments (top_k 0: off; its default is 50)."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": max(self.top_k, 0), "top_p": self.top_p,
                "min_p": self.min_p or None}

    def __str__(self) -> str:
        if self.greedy:
            return "greedy"
        return f"sampled (temperature {self.temperature:g}, top_k {self.top_k}, top_p {self.top_p:g}, min_p {self.min_p:g})"


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(batch)]


def weight_elements(llm) -> int:
    return sum(linear.in_features * linear.out_features for linear in llm.llm_engine.runner.model.linears())


def weight_bytes_per_step(llm) -> int:
    """Bytes of every projection and the LM head as a decode step reads them (the embedding
    lookup reads one row per token, and the norms are a few KB)."""
    total = 0
    for linear in llm.llm_engine.runner.model.linears():
        if linear.small is not None:
            total += linear.small.nbytes
        else:
            total += linear.in_features * linear.out_features * 4
    return total


def kv_bytes_per_token(llm) -> int:
    """Bytes of K and V a decode step reads for each token of a sequence's context, in the
    engine's KV dtype (every layer's KV heads)."""
    runner = llm.llm_engine.runner
    cfg = runner.model.config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * runner.kv_dtype.itemsize


def run_pagedllm(llm, batch: int, prompt_len: int, new_tokens: int, seed: int, sampling: Sampling = Sampling()) -> Rate:
    params = sampling.params(new_tokens, seed)
    vocab = llm.llm_engine.model_config.vocab_size
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(batch, prompt_len, vocab, seed)], params, use_tqdm=False)
    first = min(o.metrics.first_token_time for o in outputs)
    last = max(o.metrics.last_token_time for o in outputs)
    return Rate(batch * (new_tokens - 1) / (last - first))


class _TokenClock:
    """A transformers streamer that notes when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:  # the first call carries the prompt
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(model, batch: int, prompt_len: int, new_tokens: int, seed: int, sampling: Sampling = Sampling()) -> Rate:
    ids = torch.tensor(prompts(batch, prompt_len, SMOLLM2_135M["vocab_size"], seed))
    clock = _TokenClock()
    torch.manual_seed(seed)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=0, streamer=clock, **sampling.transformers())
    return Rate(batch * (len(clock.times) - 1) / (clock.times[-1] - clock.times[0]))


def prefill_pagedllm(llm, prompt: list[int]) -> float:
    """Prompt tokens/s of one prompt prefilled alone (a new prompt: nothing from the prefix cache)."""
    from pagedllm import SamplingParams

    output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return len(prompt) / (output.metrics.first_token_time - output.metrics.arrival_time)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF file or model folder (default: a random model of SmolLM2-135M's shape)")
    parser.add_argument("--against", default="transformers", choices=["transformers", "llama.cpp", "none"],
                        help="the baseline in the same run: transformers' generate, or llama.cpp (llama-cpp-python) on the same "
                             "GGUF file, batch 1 through its generate loop, larger batches as parallel sequences in one context, and a 512-token prefill")
    parser.add_argument("--quantization", default=None, choices=["int8", "q4", "gguf", "none"],
                        help="pagedllm's weights (a GGUF file keeps its blocks by default)")
    parser.add_argument("--decode-backend", default="auto", choices=["auto", "fused", "torch"], help="pagedllm's decode step: fused (one C call), torch (modules) or auto (default: %(default)s)")
    parser.add_argument("--int8-activations", default="default", choices=["default", "off", "on", "both"],
                        help="the engine argument int8_activations: default is the engine's (on for block-quantized "
                             "weights), off the exact path; both: an engine of each, measured in turns")
    parser.add_argument("--prompt-len", type=int, default=128, help='prompt tokens of each sequence (default: %(default)s)')
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens each sequence decodes, measured (default: 64; 128 with --full)")
    parser.add_argument("--batch-sizes", default="1,8", help='comma-separated batch sizes, one row of results each (default: %(default)s)')
    parser.add_argument("--num-scheduler-steps", default=None,
                        help="pagedllm's greedy steps per engine step (multi-step scheduling), one row of results per "
                             "value; 'default' is the engine's own (4 for offline generate, which this measures) "
                             "(default: default; default,1,8 with --full)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each measurement, each between two bandwidth reads; all are printed (default: 1; 3 with --full)")
    parser.add_argument("--full", action="store_true",
                        help="the long run docs/engine.md's figures come from (3 repeats, 128 tokens, 1 and 8 scheduler "
                             "steps: minutes) instead of the quick one (well under 2 minutes on 2 cores)")
    parser.add_argument("--seed", type=int, default=0, help="random prompts' seed (default: %(default)s)")
    parser.add_argument("--engine-arg", action="append", metavar="NAME=VALUE",
                        help="an extra engine argument for pagedllm (repeatable), e.g. kv_cache_dtype=bfloat16")
    parser.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "pagedllm-bench-smollm2-135m-random", help='where the random SmolLM2-shaped model is written once and reused (default: %(default)s)')
    parser.add_argument("--skip-transformers", action="store_true", help="the same as --against none")
    parser.add_argument("--prefill-len", type=int, default=512, help="--against llama.cpp: prompt tokens of the prefill measurement")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample instead of decoding greedily (0, the default: greedy), every engine with the same temperature "
                             "and filters below, seeded by --seed; llama.cpp then runs batch 1 only (its parallel loop is greedy)")
    parser.add_argument("--top-k", type=int, default=-1, help="with --temperature: top-k (-1, the default: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (default: %(default)s, off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="with --temperature: min-p (default: %(default)s, off)")


def sampling_of(args: argparse.Namespace) -> Sampling:
    """The run's Sampling; filters without a temperature are refused (greedy would ignore them)."""
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    if sampling.greedy and sampling != Sampling():
        raise SystemExit("--top-k, --top-p and --min-p filter a sampled decode: give --temperature too")
    return sampling


@dataclass
class Run:
    tok_s: float
    bandwidth: float  # bytes/s: the higher of the reads just before and just after the run


def _measure(engines: list[tuple[str, object]], batches: list[int], repeats: int) -> dict[str, dict[int, list[Run]]]:
    """`engines`: (label, fn(batch) -> Rate). They take turns, one run each per round, so a
    stretch of a busier or quieter machine falls on all of them alike."""
    runs = {label: {batch: [] for batch in batches} for label, _ in engines}
    bar = tqdm(total=repeats * len(batches) * len(engines), desc="decode runs", unit="run", dynamic_ncols=True)
    for _ in range(repeats):
        for batch in batches:
            for label, fn in engines:
                bar.set_postfix_str(f"{label}, batch {batch}")
                before = read_bandwidth()
                rate = fn(batch)
                bar.update()
                if rate is not None:  # None: this engine does not run this batch size
                    runs[label][batch].append(Run(rate.tok_s, max(before, read_bandwidth())))
    bar.close()
    for label, _ in engines:
        runs[label] = {batch: r for batch, r in runs[label].items() if r}
        for batch in runs[label]:
            print(f"{label} batch {batch}: " + ", ".join(f"{r.tok_s:.1f} ({r.bandwidth / 1e9:.0f} GB/s)" for r in runs[label][batch])
                  + " tok/s (read bandwidth around each run)", flush=True)
    return runs


def paired_ratios(ours: list[Run], theirs: list[Run]) -> list[float]:
    """Each round's rate over the anchor's in the same round: the engines take turns, so a
    round's runs share a stretch of the machine, where the best of one engine and the best of
    the other may come from different stretches (on a shared VM the anchor's own runs swing
    by 20 %)."""
    return [a.tok_s / b.tok_s for a, b in zip(ours, theirs)]


def _print_ratios(results: list[tuple[str, dict[int, list[Run]]]], anchor: str) -> None:
    base = dict(results)[anchor]
    for label, rates in results:
        for batch, runs in rates.items():
            if label == anchor or batch not in base:
                continue
            ratios = paired_ratios(runs, base[batch])
            best = max(r.tok_s for r in runs) / max(r.tok_s for r in base[batch])
            print(f"{label} against {anchor}, batch {batch}: {', '.join(f'{x:.2f}x' for x in ratios)} per round "
                  f"(median {statistics.median(ratios):.2f}x); best to best {best:.2f}x")


def _limit(bandwidth: float, peak: float, weights: int, elements: int, batch: int, kv_per_sequence: float = 0.0) -> float:
    """Steps/s a batch can reach: the weights read once a step with each sequence's K/V, or the
    matmuls at the peak."""
    return min(bandwidth / (weights + batch * kv_per_sequence), peak / (2 * elements * batch))


def _steps_label(llm, steps: int | None) -> str:
    """How many greedy steps the measured (offline, FINAL_ONLY) requests take a burst."""
    if steps is None:
        taken = llm.llm_engine.planner.final_only_steps
        return f"{taken} step{'s' if taken > 1 else ''} by default"
    return f"{steps} step{'s' if steps > 1 else ''}"


QUICK = {"new_tokens": 64, "num_scheduler_steps": "default", "repeats": 1}
FULL = {"new_tokens": 128, "num_scheduler_steps": "default,1,8", "repeats": 3}


def resolve_defaults(args: argparse.Namespace) -> None:
    """The quick run's sizes unless --full (flags given by name win either way)."""
    for name, value in (FULL if args.full else QUICK).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    resolve_defaults(args)
    sampling = sampling_of(args)
    folder = args.model or build_model(args.model_cache)
    against = "none" if args.skip_transformers else args.against
    batches = [int(b) for b in args.batch_sizes.split(",")]
    library = kernels.load()
    print(f"model: {args.model or 'random SmolLM2-135M shape'}; prompt {args.prompt_len} tokens, {args.new_tokens} tokens {sampling}; "
          f"{torch.get_num_threads()} threads; kernels: {kernels.isa(library) if library else 'none (no compiler)'}; "
          f"CPU: {kernels.cpu_model() or 'unknown'}")
    bandwidth, peaks = read_bandwidth(), {int8: measure_cpu_peak(int8) for int8 in (False, True)}
    engine_args = {"decode_backend": args.decode_backend, "max_num_seqs": max(batches)}
    if args.quantization:
        engine_args["quantization"] = args.quantization
    engine_args.update(parse_engine_args(args.engine_arg))
    engines, int8_of = [], {}
    modes = {"default": [None], "off": [False], "on": [True], "both": [False, True]}[args.int8_activations]
    for steps, int8 in [(None if s == "default" else int(s), m) for s in args.num_scheduler_steps.split(",") for m in modes]:
        llm = LLM(str(folder), num_scheduler_steps=steps, **engine_args, int8_activations=int8)
        int8 = llm.llm_engine.config.int8_activations
        weights, elements = weight_bytes_per_step(llm), weight_elements(llm)
        kv = kv_bytes_per_token(llm) * (args.prompt_len + args.new_tokens / 2)  # a sequence's K/V at its mean context
        for batch in batches:  # warm-up, long enough for the fused step to have tried both thread counts at each size
            run_pagedllm(llm, batch, args.prompt_len, 64, args.seed, sampling)
        weights_kind = (llm.llm_engine.config.quantization or "fp32") + (", int8 activations" if int8 else "")
        name = f"pagedllm ({weights_kind}, {args.decode_backend}, {_steps_label(llm, steps)})"
        int8_of[name] = bool(int8)
        engines.append((name, functools.partial(
            lambda llm, b: run_pagedllm(llm, b, args.prompt_len, args.new_tokens, args.seed, sampling), llm)))
    if against == "llama.cpp":
        engines.append(_llama_cpp_engine(args, llm, sampling))
    if against == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        run_transformers(model, 1, 8, 4, args.seed, sampling)  # warm-up
        engines.append(("transformers (fp32)",
                        lambda b: run_transformers(model, b, args.prompt_len, args.new_tokens, args.seed, sampling)))
    results = list(_measure(engines, batches, args.repeats).items())
    if against == "llama.cpp":
        _prefill(args, llm, engines[-1][1].llama)
    every_run = [r.bandwidth for _, rates in results for runs in rates.values() for r in runs]
    bandwidth = max(bandwidth, read_bandwidth(), *every_run)  # the best seen in the whole run
    peaks = {int8: max(peak, measure_cpu_peak(int8)) for int8, peak in peaks.items()}
    print(f"read bandwidth ({torch.get_num_threads()} threads): best {bandwidth / 1e9:.1f} GB/s, lowest next to a run "
          f"{min(every_run) / 1e9:.1f} GB/s; weights read per step: {weights / 1e6:.1f} MB -> {bandwidth / weights:.1f} "
          f"steps/s at the best (+ {kv / 1e6:.1f} MB of K/V a sequence at its mean context); arithmetic peak fp32 {peaks[False] / 1e9:.1f} GFLOP/s, int8 {peaks[True] / 1e9:.1f} GOP/s")
    print("| engine | batch | decode tok/s (best) | steps/s | limit at the best bandwidth (steps/s) | share of it "
          "| share of the limit around each run (median) |")
    print("|---|---|---|---|---|---|---|")
    for label, rates in results:
        for batch, runs in rates.items():
            if label.startswith("llama.cpp"):
                print(f"| {label} | {batch} | {max(r.tok_s for r in runs):.1f} | | | | |")
                continue
            peak = peaks[int8_of.get(label, False)]
            best, limit = max(r.tok_s for r in runs) / batch, _limit(bandwidth, peak, weights, elements, batch, kv)
            paired = statistics.median(r.tok_s / batch / _limit(r.bandwidth, peak, weights, elements, batch, kv) for r in runs)
            print(f"| {label} | {batch} | {best * batch:.1f} | {best:.1f} | {limit:.1f} | {best / limit:.0%} | {paired:.0%} |")
    if against != "none":
        _print_ratios(results, engines[-1][0])
    return 0


class _LlamaCpp:
    """llama.cpp's decode as an engine of `_measure`: one sequence through its own generate loop
    (greedy or sampled by its sampler chain), a greedy batch as parallel sequences in one context
    (llama_cpp.ParallelDecoder, one per batch size; a sampled batch is not run)."""

    def __init__(self, llama, args: argparse.Namespace, vocab: int, sampling: Sampling):
        self.llama, self.args, self.vocab, self.sampling = llama, args, vocab, sampling
        self.parallel = {}

    def __call__(self, batch: int) -> Rate | None:
        from pagedllm.bench import llama_cpp

        requests = prompts(batch, self.args.prompt_len, self.vocab, self.args.seed)
        if batch == 1:
            return Rate(llama_cpp.decode_rate(self.llama, requests[0], self.args.new_tokens, self.sampling.llama_cpp(),
                                              self.args.seed))
        if not self.sampling.greedy:
            return None
        if batch not in self.parallel:
            context = batch * (self.args.prompt_len + self.args.new_tokens + 16)
            self.parallel[batch] = llama_cpp.ParallelDecoder(self.llama, batch, context, torch.get_num_threads())
            self.parallel[batch].rate(requests, 8)  # warm-up
        return Rate(self.parallel[batch].rate(requests, self.args.new_tokens))


def _llama_cpp_engine(args: argparse.Namespace, llm, sampling: Sampling) -> tuple[str, _LlamaCpp]:
    from pagedllm.bench import llama_cpp
    from pagedllm.gguf import is_gguf

    if not is_gguf(args.model or ""):
        raise SystemExit("--against llama.cpp needs --model FILE.gguf (llama.cpp reads the same file)")
    llama = llama_cpp.load(str(args.model), torch.get_num_threads(), max(args.prompt_len + args.new_tokens, args.prefill_len) + 16)
    engine = _LlamaCpp(llama, args, llm.llm_engine.model_config.vocab_size, sampling)
    engine(1)  # warm-up
    return f"llama.cpp ({Path(args.model).name}, {torch.get_num_threads()} threads, {llama_cpp.build_features()})", engine


def _prefill(args: argparse.Namespace, llm, llama) -> None:
    """Prompt tokens/s of a fresh `prefill_len`-token prompt, the engines taking turns."""
    from pagedllm.bench import llama_cpp

    vocab = llm.llm_engine.model_config.vocab_size
    ours, theirs = [], []
    for round_ in range(args.repeats):
        prompt = prompts(1, args.prefill_len, vocab, args.seed + 1000 + round_)[0]
        ours.append(prefill_pagedllm(llm, prompt))
        theirs.append(llama_cpp.prefill_rate(llama, prompt))
    print(f"prefill of {args.prefill_len} tokens, tok/s each round: pagedllm {', '.join(f'{r:.0f}' for r in ours)}; "
          f"llama.cpp {', '.join(f'{r:.0f}' for r in theirs)}; best {max(ours):.0f} vs {max(theirs):.0f} "
          f"({max(ours) / max(theirs):.2f}x)")
