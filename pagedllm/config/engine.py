"""Engine arguments, built once at the entry point and passed down.

`EngineConfig` holds the engine arguments users pass to `LLM(...)` / `pagedllm serve`, validated
here so that a bad value fails with the argument's name before anything is allocated.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagedllm.config.model import ModelConfig
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.layers.quantization import QUANTIZATION_METHODS

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# LoRA pairs' element type (vLLM's lora_dtype); "auto": lora/manager.pair_dtype decides
LORA_DTYPES = ("auto", "float32", "bfloat16")

PREEMPTION_POLICIES = ("priority", "fcfs", "longest", "shortest_remaining", "recompute_cost")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (free pages alone undercount reclaimable cache)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class EngineConfig:
    """Engine arguments (vLLM's names). Sizes the KV pool and bounds each scheduler step."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    # Whom preemption takes first: priority (lowest priority, then latest arrival: the design's
    # default) | fcfs (latest admitted) | longest (most tokens held) | shortest_remaining |
    # recompute_cost (cheapest recompute per block freed); engine/scheduler.py
    preemption_policy: str = "priority"
    # Share of the KV pool kept free (vLLM's BlockSpaceManager watermark): no admission or swap-in
    # may leave fewer free blocks while something runs, and a step that starts below it preempts
    # first (design 000, Algorithm 2 phase 4); int(watermark * blocks), so 0 blocks on small pools
    watermark: float = 0.01
    # The most tokens one prefill chunk may take in a step (vLLM's name); 0: no cap beyond the budget
    long_prefill_token_threshold: int = 0
    # Zero a freed KV block (device pool and swap space) before it can be handed to another
    # sequence; prefix-cached blocks are zeroed when evicted (design 001, SECURE_MODE)
    secure_kv_blocks: bool = False
    swap_space: int = 1 << 30
    seed: int = 0
    # auto | kernel | triton | sdpa: the C attention kernels (CPU), the Triton ones (GPU) or SDPA;
    # auto takes the C kernels on CPU (fp32) and Triton on CUDA, SDPA where neither can run
    attention_backend: str = "auto"
    # auto | fused | torch: small all-decode steps as one C call (models/fused_decode.py) or modules
    decode_backend: str = "auto"
    # Weight-only: "int8" (per-channel scales) or "q4" (Q4_1 blocks of 32) quantized at load; "gguf" keeps
    # a GGUF file's blocks (the default for GGUF files); "none" dequantizes a GGUF file (layers/quantization.py)
    quantization: str | None = None
    # CPU, block-quantized weights ("gguf" or "q4"): the small-M kernels quantize each row's
    # activations to int8 per block of 32 (llama.cpp's Q8_1 way) and multiply with integer dot
    # products (VNNI where the CPU has it) instead of dequantizing every weight exactly in fp32:
    # 1.5x faster decode steps, results no longer bit-exact (perplexity +0.43 %, docs/engine.md,
    # "int8 activations"). None (the default): on for block-quantized weights, as llama.cpp does;
    # False is the exact path the parity tests take
    int8_activations: bool | None = None
    # The KV pool's element type (vLLM's name): "auto" is the model's dtype; "bfloat16" or "float16"
    # (llama.cpp's default cache type: 3 more mantissa bits, range to 65504) halve the pool of a
    # float32 model on CPU (the C attention kernels widen each element exactly as they read it):
    # twice the tokens in the same memory, half the bytes a decode step's attention reads
    kv_cache_dtype: str = "auto"
    # With no num_kv_blocks / kv_cache_memory (CPU; a GPU measures what it has left): the pool
    # holds one full context, max(max_model_len, max_num_batched_tokens) tokens shared by every
    # running sequence, as llama.cpp sizes its cache by n_ctx, capped by a quarter of free memory.
    # A fraction given here sizes it from free memory instead (at most max_num_seqs full contexts).
    kv_cache_memory_fraction: float | None = None
    # Split the model across this many processes on this host (gloo on CPU, NCCL on CUDA).
    tensor_parallel_size: int = 1
    # Layer-wise KV offload: the pool lives in host memory, the device holds two layers' buffers
    # of `kv_offload_device_memory` bytes in all (default: two layers of the whole pool).
    kv_offload: bool = False
    kv_offload_device_memory: int | None = None
    # {"model": DIR, "num_speculative_tokens": k} or {"method": "ngram", ...}; JSON text from the CLI
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Greedy decode steps per engine step when every sequence of a step is a plain greedy decode
    # (multi-step scheduling, step/planner.py); needs the fused decode step, else 1. None (the
    # default): a burst only for requests whose output is returned whole (RequestOutputKind.
    # FINAL_ONLY, as offline LLM.generate asks), whose tokens nobody sees arrive; 1 step for the rest
    num_scheduler_steps: int | None = None
    # Schedule the next step while the device runs this one, and take this one's output back
    # meanwhile (vLLM's name; engine/scheduler.py). Off where nothing can overlap: the fused CPU
    # step, tensor parallelism, KV offload, speculation (step/planner.py says why)
    async_scheduling: bool = False
    # CUDA graphs for decode steps (worker/cuda_graphs.py) unless this is set (vLLM's name)
    enforce_eager: bool = False
    # CUDA: the share of the GPU's memory the engine may use; the KV pool gets what the weights
    # and a profiling forward at the largest batch leave of it (vLLM's name and default)
    gpu_memory_utilization: float = 0.9
    # LoRA adapters (vLLM's names, lora/): requests may name a PEFT adapter (LoRARequest); up to
    # max_loras distinct adapters run in one step, of rank <= max_lora_rank; max_cpu_loras
    # (default max_loras) stay loaded in host memory, least recently used dropped first
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the adapters' low-rank pairs' element type (vLLM's lora_dtype): float32 (exact: PEFT's
    # tokens), bfloat16 (half the bytes a decode step reads for them, the sums still in float32),
    # or auto (bfloat16 for a float32 model on the CPU, else the model's dtype; lora/manager.pair_dtype)
    lora_dtype: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.extra:
            raise ValueError(f"unknown engine argument(s): {sorted(self.extra)}")
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        for name in ("num_kv_blocks", "kv_cache_memory", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.dtype not in (*_DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {[*_DTYPES, 'auto']}, got {self.dtype!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"preemption_policy must be one of {list(PREEMPTION_POLICIES)}, got {self.preemption_policy!r}")
        if not isinstance(self.watermark, (int, float)) or isinstance(self.watermark, bool) or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be a share of the KV pool in [0, 1), got {self.watermark!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold caps prefill chunks; it needs enable_chunked_prefill=True")
        if self.attention_backend not in ("auto", "kernel", "triton", "sdpa"):
            raise ValueError(f"attention_backend must be 'auto', 'kernel', 'triton' or 'sdpa', got {self.attention_backend!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.decode_backend not in ("auto", "fused", "torch"):
            raise ValueError(f"decode_backend must be 'auto', 'fused' or 'torch', got {self.decode_backend!r}")
        if self.decode_backend == "fused" and self.attention_backend in ("sdpa", "triton"):
            raise ValueError("decode_backend='fused' attends with the C decode kernel; it cannot run with "
                             f"attention_backend={self.attention_backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got {self.quantization!r}")
        from pagedllm.gguf import is_gguf

        if self.quantization is None and is_gguf(self.model):
            self.quantization = "gguf"
        if self.quantization == "gguf" and not is_gguf(self.model):
            raise ValueError("quantization='gguf' keeps a GGUF file's blocks; the model is not a GGUF file")
        if self.int8_activations is None:
            self.int8_activations = self.quantization in ("gguf", "q4")
        if self.int8_activations and self.quantization not in ("gguf", "q4"):
            raise ValueError("int8_activations multiplies block-quantized weights: it needs quantization='gguf' (a GGUF "
                             f"file) or 'q4', got {self.quantization!r}")
        if self.quantization == "q4" and self.tensor_parallel_size > 1:
            raise ValueError("quantization='q4' is not supported with tensor_parallel_size > 1")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.9]")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto":
            clashes = {"tensor_parallel_size > 1": self.tensor_parallel_size > 1, "kv_offload": self.kv_offload,
                       "a draft model": self.speculative_config is not None and self.speculative_config.uses_draft_model}
            for name, clash in clashes.items():
                if clash:
                    raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with {name}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_scheduler_steps is not None:
            _positive("num_scheduler_steps", self.num_scheduler_steps)
        spec = self.speculative_config
        if (self.num_scheduler_steps or 1) > 1 and spec is not None and not (spec.uses_draft_model and spec.fused_cycles):
            raise ValueError("num_scheduler_steps > 1 with speculative_config needs a draft model with fused_cycles "
                             "(its greedy cycles then run num_scheduler_steps per engine step)")
        if self.tensor_parallel_size > 1 and self.speculative_config is not None:
            raise ValueError("speculative_config is not supported with tensor_parallel_size > 1")
        if self.kv_offload_device_memory is not None:
            _positive("kv_offload_device_memory", self.kv_offload_device_memory)
        if self.kv_offload:
            clashes = {"preemption_mode='swap'": self.preemption_mode == "swap",
                       "speculative_config": self.speculative_config is not None,
                       "tensor_parallel_size > 1": self.tensor_parallel_size > 1}
            for name, clash in clashes.items():
                if clash:
                    raise ValueError(f"kv_offload is not supported with {name} (the pool already lives in host memory)"
                                     if "swap" in name else f"kv_offload is not supported with {name}")

        self._check_lora()

    def _check_lora(self) -> None:
        """LoRA's sizes, and the features adapters cannot run with (refused by name)."""
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if isinstance(self.lora_dtype, torch.dtype):  # (vLLM takes a torch dtype too)
            self.lora_dtype = str(self.lora_dtype).removeprefix("torch.")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {list(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if not self.enable_lora:
            return
        clashes = {"speculative_config": self.speculative_config is not None,
                   "tensor_parallel_size > 1": self.tensor_parallel_size > 1,
                   "num_scheduler_steps > 1": (self.num_scheduler_steps or 1) > 1}
        for name, clash in clashes.items():
            if clash:
                raise ValueError(f"enable_lora is not supported with {name}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"extra", "model"}
        extra = {k: v for k, v in kwargs.items() if k not in known}
        return cls(model=model, extra=extra, **{k: v for k, v in kwargs.items() if k in known})

    def check_model(self, model_config: ModelConfig) -> None:
        """What can be told about these arguments and this model before anything is loaded (the
        server checks it before binding its port): the context length, the step budget, and that
        tensor parallelism divides the model; a ValueError naming the argument otherwise."""
        max_model_len = self.resolve_max_model_len(model_config)
        self.resolve_max_num_batched_tokens(max_model_len)
        model_config.shard(self.tensor_parallel_size)

    def torch_device(self, rank: int = 0) -> torch.device:
        """The device of tensor-parallel rank `rank`: on CUDA, GPU `rank` (of an unindexed device)."""
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device)
        if device.type == "cuda" and device.index is None and self.tensor_parallel_size > 1:
            return torch.device("cuda", rank)
        return device

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        return resolve_dtype(self.dtype, model_config.config_dtype, self.torch_device())

    def kv_torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The KV pool's element type: the model's dtype unless kv_cache_dtype names one."""
        return _DTYPES[self.kv_cache_dtype] if self.kv_cache_dtype != "auto" else self.torch_dtype(model_config)

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        return self.max_model_len

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                    f"max_model_len={max_model_len}; without chunked prefill a long prompt could "
                    "never be scheduled (enable_chunked_prefill=True or raise the budget)"
                )
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)


def resolve_dtype(requested: str, config_dtype: str | None, device: torch.device,
                  bf16_supported: bool | None = None) -> torch.dtype:
    """The engine's compute dtype.

    `auto` is fp32 on CPU: CPUs without bf16 units run bf16 matmuls several times slower, and
    fp32 is what the parity guarantees are stated in. On a GPU it is the checkpoint's dtype when
    that is bf16 or fp16, else (fp32 or unset checkpoints) bf16, as vLLM does; where the GPU has no
    bf16 (before compute capability 8.0) bf16 becomes fp16. An explicit dtype is honoured, and an
    explicit bf16 on a GPU without it is an error."""
    if device.type == "cpu":
        return torch.float32 if requested == "auto" else _DTYPES[requested]
    if bf16_supported is None:
        bf16_supported = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if requested != "auto":
        if requested == "bfloat16" and not bf16_supported:
            raise ValueError("dtype='bfloat16' is not supported by this GPU (compute capability < 8.0); use 'float16'")
        return _DTYPES[requested]
    wanted = _DTYPES.get(str(config_dtype))
    if wanted not in (torch.bfloat16, torch.float16):
        wanted = torch.bfloat16
    return torch.float16 if wanted is torch.bfloat16 and not bf16_supported else wanted


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
