"""Offline throughput: pagedllm vs transformers' batched generate on the same requests.

A nano-vLLM-style workload sized for a 2-core CPU: N requests with random prompt lengths and
random output lengths (ignore_eos), on a randomly initialised model with SmolLM2-135M's shape
(`--shape llama-160m`: 12 heads, which tensor parallelism can split; `--shape mixtral-small`: a
small Mixtral, 8 experts, top 2).
The baseline runs the same requests through transformers' `generate` as one left-padded batch,
which must run every sequence to the longest output; both are credited only with the tokens
each request asked for. The share of the machine's fp32 matmul peak (measured in this run) is
computed from the useful FLOPs: 2 x parameters per token processed (lm_head only where a token
is sampled; for a mixture of experts, the router and the top-k experts a token uses) plus
attention's 4 x context x hidden per layer.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.bench.workload import Workload, make_workload
from pagedllm.matmul_peak import measure_matmul_peak

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
SHAPES = {"smollm2-135m": ("LlamaConfig", SMOLLM2_135M), "llama-160m": ("LlamaConfig", LLAMA_160M),
          "mixtral-small": ("MixtralConfig", MIXTRAL_SMALL), "llama-1b": ("LlamaConfig", LLAMA_1B)}
# Workload defaults per device: (requests, min prompt, max prompt, min output, max output)
WORKLOADS = {"cpu": (64, 32, 160, 64, 256), "cuda": (256, 64, 512, 64, 512)}


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


def run_pagedllm(folder: Path, workload: Workload, engine_args: dict) -> float:
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(folder), **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    llm.generate(workload.prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    llm.llm_engine.shutdown()
    del llm
    return elapsed


def run_transformers(folder: Path, workload: Workload) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    longest = max(len(p) for p in workload.prompts)
    ids = torch.zeros(len(workload.prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(workload.prompts):  # left padding
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    with torch.inference_mode():
        model.generate(input_ids=ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(workload.output_lens), do_sample=False, pad_token_id=0)
        return time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=sorted(WORKLOADS), default="cpu",
                        help="cuda: the GPU benchmark (bench/gpu.py), against transformers' continuous batching")
    parser.add_argument("--dtype", default="bfloat16", help="the GPU benchmark's dtype (CPU runs use float32)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 64 on cpu, 256 on cuda")
    parser.add_argument("--min-prompt", type=int, default=None, help="default 32 on cpu, 64 on cuda")
    parser.add_argument("--max-prompt", type=int, default=None, help="default 160 on cpu, 512 on cuda")
    parser.add_argument("--min-output", type=int, default=None, help="default 64 on cpu, 64 on cuda")
    parser.add_argument("--max-output", type=int, default=None, help="default 256 on cpu, 512 on cuda")
    parser.add_argument("--fixed-output-len", type=int, default=None, help="every request asks for this many tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the random model's shape")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="where the random model is kept between runs (default: the temp dir, by shape)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--kv-offload-device-memory", type=int, default=None,
                        help="also run pagedllm with layer-wise KV offload and this device KV budget in bytes")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="also run pagedllm split across this many processes (tp=1 runs too, for the ratio)")
    parser.add_argument("--padded-baseline", action="store_true",
                        help="cuda: also run transformers' padded generate in batches of 64")
    parser.add_argument("--engine-arg", action="append", metavar="NAME=VALUE",
                        help="cuda: an extra engine argument for pagedllm (repeatable)")


def _workload_defaults(args: argparse.Namespace) -> None:
    names = ("num_requests", "min_prompt", "max_prompt", "min_output", "max_output")
    for name, default in zip(names, WORKLOADS[args.device]):
        if getattr(args, name) is None:
            setattr(args, name, default)


def run(args: argparse.Namespace) -> int:
    _workload_defaults(args)
    config_class, shape = SHAPES[args.shape]
    cache = args.model_cache or Path(tempfile.gettempdir()) / f"pagedllm-bench-{args.shape}-random"
    workload = make_workload(args, shape["vocab_size"])
    if args.device == "cuda":
        from pagedllm.bench import gpu

        print(f"{args.shape}, workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
              f"{workload.output_tokens} output tokens ({min(workload.output_lens)}-{max(workload.output_lens)} per request)")
        return gpu.run(args, config_class, shape, workload, cache.with_name(cache.name + f"-{args.dtype}"))
    folder = build_model(cache, args.shape)
    print(f"{args.shape}, workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
          f"{workload.output_tokens} output tokens ({min(workload.output_lens)}-{max(workload.output_lens)} per request), "
          f"{torch.get_num_threads()} threads")
    peak = measure_matmul_peak()  # measured again at the end; the best is the machine's ceiling
    engine_args = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    ours = run_pagedllm(folder, workload, engine_args)
    tp = args.tensor_parallel_size
    split = run_pagedllm(folder, workload, {**engine_args, "tensor_parallel_size": tp}) if tp > 1 else None
    budget = args.kv_offload_device_memory
    offload = None if budget is None else run_pagedllm(folder, workload, {**engine_args, "kv_offload": True,
                                                                          "kv_offload_device_memory": budget})
    theirs = None if args.skip_transformers else run_transformers(folder, workload)
    peak = max(peak, measure_matmul_peak())
    flops = useful_flops(shape, workload)
    print(f"fp32 matmul peak (best of before and after, this run): {peak / 1e9:.1f} GFLOP/s")
    for name, seconds in (("pagedllm", ours), (f"pagedllm tp={tp}", split), ("pagedllm offload", offload),
                          ("transformers", theirs)):
        if seconds is not None:
            print(f"{name + ':':17s} {seconds:7.1f} s  {workload.output_tokens / seconds:8.1f} output tok/s  "
                  f"{flops / seconds / 1e9:6.1f} GFLOP/s useful = {flops / seconds / peak:5.1%} of peak")
    if theirs is not None:
        print(f"speed-up: {theirs / ours:.2f}x")
    if split is not None:
        print(f"tp={tp} vs tp=1: {ours / split:.2f}x")
    if offload is not None:
        print(f"layer-wise KV offload ({budget / 2**20:.0f} MiB of device KV) vs resident: {ours / offload:.2f}x")
    return 0
