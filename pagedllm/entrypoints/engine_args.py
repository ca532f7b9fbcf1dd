"""Engine arguments as command-line flags, generated from `EngineConfig`'s fields.

Shared by every command that builds an engine (`serve`, `generate`, benchmarks), so a new engine
argument becomes a flag everywhere at once.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.config.engine import KV_CACHE_DTYPES, LORA_DTYPES, PREEMPTION_POLICIES

_NOT_FLAGS = {"model", "extra"}
# What each flag does, in a line (the field's comment in config/engine.py has the why); the default is appended.
HELP = {
    "tokenizer": "a tokenizer folder other than the model's",
    "dtype": "weights' and activations' type: auto (float32 on CPU, the model's on GPU), float32, bfloat16, float16",
    "device": "auto (CUDA when there is a GPU), cpu or cuda",
    "block_size": "tokens per KV cache block (page)",
    "num_kv_blocks": "KV pool size in blocks (overrides every other sizing)",
    "kv_cache_memory": "KV pool size in bytes",
    "max_num_seqs": "sequences one step may run",
    "max_num_batched_tokens": "tokens one step may compute (2048 with chunked prefill)",
    "max_model_len": "longest prompt + answer in tokens (the model's context length)",
    "enable_prefix_caching": "reuse the KV blocks of prompts' shared prefixes",
    "enable_chunked_prefill": "split long prompts over several steps, next to decodes",
    "preemption_mode": "what preemption does with a sequence's KV: recompute it later, or swap it to host memory",
    "preemption_policy": "which running sequence preemption takes first",
    "watermark": "share of the KV pool kept free for the running sequences to grow into",
    "long_prefill_token_threshold": "most tokens one prefill chunk may take in a step (0: no cap)",
    "secure_kv_blocks": "zero a freed KV block before another sequence gets it",
    "swap_space": "host memory for swapped-out KV blocks in bytes (preemption-mode swap)",
    "seed": "the engine's base seed for sampling without a request seed",
    "attention_backend": "auto, kernel (the C kernels), triton or sdpa",
    "decode_backend": "auto, fused (small decode steps as one C call) or torch",
    "quantization": "weight quantization: int8, q4, gguf (keep a GGUF file's blocks) or none",
    "int8_activations": "int8 activations in every step on CPU, llama.cpp's arithmetic (faster, not exact); None: on for block-quantized weights (GGUF, q4), --no-int8-activations is the exact path",
    "kv_cache_dtype": "the KV pool's element type (bfloat16 or float16 halves a float32 model's pool)",
    "kv_cache_memory_fraction": ("size the KV pool as this share of free memory (default: one full context, capped "
                                 "by a quarter of free memory)"),
    "tensor_parallel_size": "processes one model is split across (must divide its attention and KV heads)",
    "kv_offload": "keep the KV pool in host memory, two layers at a time on the device",
    "kv_offload_device_memory": "device bytes for the offloaded layers' buffers",
    "speculative_config": 'speculative decoding as JSON: {"model": DIR, "num_speculative_tokens": k} or {"method": "ngram", ...}',
    "num_scheduler_steps": ("greedy decode steps per engine step (multi-step scheduling); None: 4 for requests whose "
                            "output is returned whole (offline generate), 1 where it is streamed"),
    "async_scheduling": "schedule the next step while the device runs this one",
    "enforce_eager": "no CUDA graphs for decode steps",
    "gpu_memory_utilization": "share of the GPU's memory the engine may use",
    "enable_lora": "serve LoRA adapters: requests may name a PEFT adapter (serve: --lora-modules, /v1/load_lora_adapter)",
    "max_loras": "distinct LoRA adapters one step may run",
    "max_lora_rank": "highest LoRA rank an adapter may have",
    "max_cpu_loras": "LoRA adapters kept loaded in host memory, least recently used dropped (None: max_loras)",
    "lora_dtype": ("LoRA pairs' element type: float32 (exact, PEFT's tokens), bfloat16 (half the bytes, sums in float32) or "
                   "auto (bfloat16 for a float32 model on the CPU, else the model's dtype)"),
}
# Flags whose values are a fixed set: argparse names them in --help and refuses others early.
_CHOICES = {"preemption_policy": PREEMPTION_POLICIES, "preemption_mode": ("recompute", "swap"),
            "kv_cache_dtype": KV_CACHE_DTYPES, "lora_dtype": LORA_DTYPES}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-num-seqs, --enable-prefix-caching/--no-...);
    defaults stay None so that only the flags given override the engine's own defaults."""
    group = parser.add_argument_group("engine arguments (per loaded model)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f"{HELP[f.name]} (default: {default})"  # a KeyError here: a new engine argument needs its help
        if kind in ("bool", "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            convert = int if "int" in kind else float if "float" in kind else str
            choices = _CHOICES.get(f.name)
            group.add_argument(flag, type=convert, default=None, choices=choices,
                               metavar=None if choices else f.name.upper(), help=text)


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in _NOT_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
