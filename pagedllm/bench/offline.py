"""Offline throughput: pagedllm vs transformers' batched generate on the same requests.

A nano-vLLM-style workload sized for a 2-core CPU: N requests with random prompt lengths and
random output lengths (ignore_eos), on a randomly initialised model with SmolLM2-135M's shape
(`--shape llama-160m`: 12 heads, which tensor parallelism can split; `--shape mixtral-small`: a
small Mixtral, 8 experts, top 2).
The baseline runs the same requests through transformers' `generate` as one left-padded batch,
which must run every sequence to the longest output; both are credited only with the tokens
each request asked for. The share of the machine's fp32 peak (measured in this run, matmul_peak.measure_cpu_peak) is
computed from the useful FLOPs: 2 x parameters per token processed (lm_head only where a token
is sampled; for a mixture of experts, the router and the top-k experts a token uses) plus
attention's 4 x context x hidden per layer.

`--model` runs a real model instead (a GGUF file, its blocks kept as the engine serves it, or an
HF folder); `--against vllm` runs vLLM's CPU backend as the baseline (bench/vllm_cpu.py, in its
own venv, on the dequantized HF folder of a GGUF file). `--rounds N` gives the engines N turns
each, both loaded throughout, and reports each engine's best run: on a shared VM a single run
of either moves by a fifth.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagedllm.bench.dequantized import dequantized_folder
from pagedllm.bench.engine_args import parse_engine_args
from pagedllm.bench.workload import Workload, make_workload
from pagedllm.matmul_peak import measure_cpu_peak

SMOLLM2_135M = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=100000.0,
)
MIXTRAL_SMALL = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
    tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=1000000.0,
)
LLAMA_160M = dict(  # JackFram/llama-160m's shape: heads an even number of ranks can split
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
    intermediate_size=3072, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048,
    rms_norm_eps=1e-6, rope_theta=10000.0,
)
LLAMA_1B = dict(  # Llama-3.2-1B's shape (the GPU benchmark's model)
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0,
)
# vLLM's dtypes `--vllm-dtype best` loads: the anchor's best configuration on the machine is the
# baseline, not its default (bf16 on a CPU that only emulates it ran 4x slower than its fp32).
VLLM_BEST_DTYPES = ("bfloat16", "float32")
SHAPES = {"smollm2-135m": ("LlamaConfig", SMOLLM2_135M), "llama-160m": ("LlamaConfig", LLAMA_160M),
          "mixtral-small": ("MixtralConfig", MIXTRAL_SMALL), "llama-1b": ("LlamaConfig", LLAMA_1B)}
# Workload defaults per device: (requests, min prompt, max prompt, min output, max output). On CPU
# the default is a quick run (well under 2 minutes on 2 cores, transformers included); --full is the
# workload docs/engine.md's figures were measured on (5+ minutes: transformers pads every row to 256).
WORKLOADS = {"cpu": (16, 32, 128, 32, 96), "cpu-full": (64, 32, 160, 64, 256), "cuda": (256, 64, 512, 64, 512)}


def build_model(folder: Path, shape: str = "smollm2-135m") -> Path:
    """A random model of the shape, cached between runs (weights are not the point)."""
    if (folder / "config.json").is_file():
        return folder
    import transformers

    config_class, cfg = SHAPES[shape]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**cfg, initializer_range=0.02)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def useful_flops(cfg: dict, workload: Workload) -> float:
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    experts = cfg.get("num_local_experts")
    mlp = 3 * hidden * cfg["intermediate_size"] * (cfg["num_experts_per_tok"] if experts else 1) + hidden * (experts or 0)
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + mlp
    lm_head = hidden * cfg["vocab_size"]
    total = 0.0
    for prompt, out in zip(workload.prompts, workload.output_lens):
        tokens = len(prompt) + out - 1  # every token but the last sampled one is run through the model
        total += 2 * per_layer * layers * tokens + 2 * lm_head * out
        contexts = (len(prompt) * (len(prompt) + 1)) / 2 + sum(len(prompt) + i for i in range(1, out))
        total += 4 * hidden * layers * contexts
    return total


class PagedEngine:
    """pagedllm's LLM, built once; each call is one timed run of the workload."""

    def __init__(self, folder: Path, workload: Workload, engine_args: dict):
        from pagedllm import LLM, SamplingParams

        self.llm = LLM(str(folder), **engine_args)
        self.workload = workload
        self.params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        self.llm.generate(workload.prompts[:2], self.params[:2], use_tqdm=False)  # warm-up
        self.preempted: list[int] = []  # requests preempted at least once, each run

    def pool_line(self) -> str:
        """The KV pool and how often the runs outgrew it."""
        stats = self.llm.get_stats()
        return (f"pagedllm KV pool: {stats['num_total_blocks']} blocks of {self.llm.llm_engine.config.block_size} tokens; "
                f"requests preempted each run: {', '.join(map(str, self.preempted))}")

    def __call__(self) -> float:
        self.llm.reset_prefix_cache()  # each run computes its prompts, not the previous run's KV (vLLM's worker too)
        start = time.perf_counter()
        outputs = self.llm.generate(self.workload.prompts, self.params, use_tqdm=True)  # the bar costs ~nothing a step
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert produced == self.workload.output_tokens, (produced, self.workload.output_tokens)
        self.preempted.append(sum(1 for o in outputs if o.num_preemptions))
        return elapsed

    def close(self) -> None:
        self.llm.llm_engine.shutdown()


def run_pagedllm(folder: Path, workload: Workload, engine_args: dict) -> float:
    engine = PagedEngine(folder, workload, engine_args)
    try:
        return engine()
    finally:
        engine.close()


class StepBar:
    """A logits processor that only advances a progress bar: transformers' generate shows none."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.bar.update()
        return scores


class TransformersGenerate:
    """transformers' batched generate of the same requests: one left-padded batch, run to the
    longest output."""

    def __init__(self, folder: Path, workload: Workload):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.max_new_tokens = max(workload.output_lens)
        longest = max(len(p) for p in workload.prompts)
        self.ids = torch.zeros(len(workload.prompts), longest, dtype=torch.long)
        self.mask = torch.zeros_like(self.ids)
        for row, prompt in enumerate(workload.prompts):  # left padding
            self.ids[row, longest - len(prompt):] = torch.tensor(prompt)
            self.mask[row, longest - len(prompt):] = 1
        with torch.inference_mode():
            self.model.generate(input_ids=self.ids[:2, -8:], attention_mask=self.mask[:2, -8:], max_new_tokens=2,
                                do_sample=False, pad_token_id=0)

    def __call__(self) -> float:
        from transformers import LogitsProcessorList

        bar = tqdm(total=self.max_new_tokens, desc="transformers generate", unit="step", dynamic_ncols=True)
        with torch.inference_mode():
            start = time.perf_counter()
            self.model.generate(input_ids=self.ids, attention_mask=self.mask, max_new_tokens=self.max_new_tokens,
                                do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([StepBar(bar)]))
            elapsed = time.perf_counter() - start
        bar.close()
        return elapsed

    def close(self) -> None:
        del self.model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=sorted(WORKLOADS), default="cpu",
                        help="cuda: the GPU benchmark (bench/gpu.py), against transformers' continuous batching")
    parser.add_argument("--dtype", default="bfloat16", help="the GPU benchmark's dtype (CPU runs use float32)")
    parser.add_argument("--full", action="store_true",
                        help="cpu: the long workload (64 requests, outputs of 64-256 tokens; minutes) instead of the "
                             "quick one (16 requests, outputs of 32-96 tokens)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 16 on cpu (64 with --full), 256 on cuda")
    parser.add_argument("--min-prompt", type=int, default=None, help="default 32 on cpu, 64 on cuda")
    parser.add_argument("--max-prompt", type=int, default=None, help="default 128 on cpu (160 with --full), 512 on cuda")
    parser.add_argument("--min-output", type=int, default=None, help="default 32 on cpu (64 with --full), 64 on cuda")
    parser.add_argument("--max-output", type=int, default=None, help="default 96 on cpu (256 with --full), 512 on cuda")
    parser.add_argument("--fixed-output-len", type=int, default=None, help="every request asks for this many tokens")
    parser.add_argument("--seed", type=int, default=0, help="random prompts' and weights' seed (default: %(default)s)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the random model's shape")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="where the random model is kept between runs (default: the temp dir, by shape)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="pagedllm's step token budget (default: the engine's)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a GGUF file (its blocks kept) or an HF folder instead of the random model of --shape")
    parser.add_argument("--against", choices=("transformers", "vllm", "none"), default="transformers",
                        help="the baseline in the same run: transformers' batched generate, or vLLM's CPU backend "
                             "(--vllm-python; a GGUF file as its dequantized HF folder)")
    parser.add_argument("--skip-transformers", action="store_true", help="the same as --against none")
    parser.add_argument("--rounds", type=int, default=1,
                        help="turns of each engine, both loaded throughout; each engine's best run is reported")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vLLM's CPU build (default $PAGEDLLM_VLLM_PYTHON)")
    parser.add_argument("--vllm-dtype", default="best",
                        help="vLLM's dtype: best (default: bfloat16 and float32 both loaded, taking turns, and the "
                             "faster one is the baseline -- bf16 is emulated on CPUs without AVX512-BF16 or AMX, so "
                             "its default is not always its fastest), auto (its choice), or a dtype")
    parser.add_argument("--kv-offload-device-memory", type=int, default=None,
                        help="also run pagedllm with layer-wise KV offload and this device KV budget in bytes")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="also run pagedllm split across this many processes (tp=1 runs too, for the ratio)")
    parser.add_argument("--padded-baseline", action="store_true",
                        help="cuda: also run transformers' padded generate in batches of 64")
    parser.add_argument("--engine-arg", action="append", metavar="NAME=VALUE",
                        help="an extra engine argument for pagedllm (repeatable)")
    parser.add_argument("--kv-cache-gib", type=int, default=None,
                        help="--against vllm: the KV memory of each engine, in GiB: pagedllm's kv_cache_memory and "
                             "vLLM's VLLM_CPU_KVCACHE_SPACE, the same for both (default: $VLLM_CPU_KVCACHE_SPACE, else "
                             "4); 0: pagedllm's own default pool (one full context), vLLM's 4. An --engine-arg that "
                             "sizes pagedllm's pool wins")


def _workload_defaults(args: argparse.Namespace) -> None:
    names = ("num_requests", "min_prompt", "max_prompt", "min_output", "max_output")
    workload = args.device + ("-full" if getattr(args, "full", False) and args.device == "cpu" else "")
    for name, default in zip(names, WORKLOADS[workload]):
        if getattr(args, name) is None:
            setattr(args, name, default)


def run(args: argparse.Namespace) -> int:
    _workload_defaults(args)
    config_class, shape = SHAPES[args.shape]
    cache = args.model_cache or Path(tempfile.gettempdir()) / f"pagedllm-bench-{args.shape}-random"
    if args.device == "cuda":
        from pagedllm.bench import gpu

        workload = make_workload(args, shape["vocab_size"])
        print(f"{args.shape}, workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
              f"{workload.output_tokens} output tokens ({min(workload.output_lens)}-{max(workload.output_lens)} per request)")
        return gpu.run(args, config_class, shape, workload, cache.with_name(cache.name + f"-{args.dtype}"))
    folder, shape = (args.model, _shape_of(args.model)) if args.model else (build_model(cache, args.shape), shape)
    workload = make_workload(args, shape["vocab_size"])
    print(f"{args.model or args.shape}, workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} "
          f"tokens, {workload.output_tokens} output tokens ({min(workload.output_lens)}-{max(workload.output_lens)} per "
          f"request), {torch.get_num_threads()} threads")
    peak = measure_cpu_peak()  # fp32; measured again at the end; the best is the machine's ceiling
    engine_args = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    engine_args.update(parse_engine_args(args.engine_arg))
    if args.against == "vllm" and not args.skip_transformers:
        from pagedllm.bench.vllm_cpu import kv_cache_gib_default

        if args.kv_cache_gib is None:
            args.kv_cache_gib = kv_cache_gib_default()
        engine_args = _with_kv_memory(engine_args, args.kv_cache_gib)
    times = _turns(args, folder, workload, engine_args)
    ours = min(times["pagedllm"])
    tp = args.tensor_parallel_size
    split = run_pagedllm(folder, workload, {**engine_args, "tensor_parallel_size": tp}) if tp > 1 else None
    budget = args.kv_offload_device_memory
    offload = None if budget is None else run_pagedllm(folder, workload, {**engine_args, "kv_offload": True,
                                                                          "kv_offload_device_memory": budget})
    peak = max(peak, measure_cpu_peak())
    flops = useful_flops(shape, workload)
    print(f"fp32 peak (best of before and after, this run): {peak / 1e9:.1f} GFLOP/s")
    baselines = [name for name in times if name != "pagedllm"]
    baseline = min(baselines, key=lambda name: min(times[name])) if baselines else None  # the fastest of them
    for name, seconds in (("pagedllm", ours), (f"pagedllm tp={tp}", split), ("pagedllm offload", offload),
                          *((name, min(times[name])) for name in baselines)):
        if seconds is not None:
            print(f"{name + ':':17s} {seconds:7.1f} s  {workload.output_tokens / seconds:8.1f} output tok/s  "
                  f"{flops / seconds / 1e9:6.1f} GFLOP/s useful = {flops / seconds / peak:5.1%} of peak")
    if args.rounds > 1:
        for name, runs in times.items():
            print(f"{name} output tok/s each round: " + ", ".join(f"{workload.output_tokens / s:.1f}" for s in runs))
    if baseline is not None:
        best = " (the fastest baseline)" if len(baselines) > 1 else ""
        print(f"speed-up over {baseline}{best}: {min(times[baseline]) / ours:.2f}x")
    if split is not None:
        print(f"tp={tp} vs tp=1: {ours / split:.2f}x")
    if offload is not None:
        print(f"layer-wise KV offload ({budget / 2**20:.0f} MiB of device KV) vs resident: {ours / offload:.2f}x")
    return 0


def _shape_of(model: Path) -> dict:
    """A real model's sizes under the config.json names useful_flops reads."""
    from pagedllm.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model)
    if cfg.moe is not None:
        raise SystemExit("bench offline --model takes dense models (useful_flops counts a dense MLP)")
    return dict(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size)


POOL_ARGS = ("kv_cache_memory", "num_kv_blocks", "kv_cache_memory_fraction")


def _with_kv_memory(engine_args: dict, gib: int) -> dict:
    """Against vLLM, pagedllm's KV pool of `gib` GiB, the space vLLM's worker gets, unless the
    engine arguments size the pool themselves (or gib is 0: the engine's own default, one full
    context, under which the long workload's 64 requests preempt: 27 recomputed, -8 to -11 %)."""
    if gib <= 0 or any(name in engine_args for name in POOL_ARGS):
        return engine_args
    return {**engine_args, "kv_cache_memory": gib << 30}


def _turns(args: argparse.Namespace, folder: Path, workload: Workload, engine_args: dict) -> dict[str, list[float]]:
    """Seconds of each engine's runs, the engines taking turns, all of them loaded throughout."""
    engines = {"pagedllm": PagedEngine(folder, workload, engine_args)}
    against = "none" if args.skip_transformers else args.against
    gguf = folder.is_file()
    try:
        if against == "vllm":
            from pagedllm.bench import vllm_cpu

            python = vllm_cpu.python_of(args.vllm_python)
            reference = dequantized_folder(folder) if gguf else folder
            for dtype in VLLM_BEST_DTYPES if args.vllm_dtype == "best" else (args.vllm_dtype,):
                engine = vllm_cpu.VllmCpu(python, reference, workload, dtype, kv_cache_gib=args.kv_cache_gib or None)
                engines[f"vLLM {engine.info['version']} CPU ({engine.info['dtype']})"] = engine
        elif against == "transformers":
            engines["transformers"] = TransformersGenerate(dequantized_folder(folder) if gguf else folder, workload)
        times = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(engine())
        print(engines["pagedllm"].pool_line())
        return times
    finally:
        for engine in engines.values():
            engine.close()
