"""Engine and model configuration, built once at the entry point and passed down.

`ModelConfig` is read from a Hugging Face `config.json` (both the transformers ≥ 5 spelling,
`rope_parameters`, and the older `rope_theta` + `rope_scaling`) or a GGUF file's metadata. `EngineConfig` holds the engine
arguments users pass to `LLM(...)` / `pagedllm serve`, validated here so that a bad value fails
with the argument's name before anything is allocated.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from pagedllm.layers.quantization import QUANTIZATION_METHODS
from pagedllm.spec_decode.config import SpeculativeConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelLoadError(ValueError):
    """A model folder that is missing, incomplete, corrupt or of an unsupported architecture."""


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's feed-forward: which layers route, to how many experts."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # the kept top-k router weights are rescaled to sum to 1
    shared_expert_intermediate_size: int  # 0: none (Qwen2-MoE has one, gated by a sigmoid)
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_type: str, num_layers: int, intermediate: int) -> "MoEConfig | None":
        if model_type == "mixtral":
            return cls(int(raw.get("num_local_experts", 8)), int(raw.get("num_experts_per_tok", 2)), intermediate,
                       True, 0, (True,) * num_layers)
        if model_type not in ("qwen2_moe", "qwen3_moe"):
            return None
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)  # transformers 5 writes the latter
        step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or [])
        sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return cls(num_experts, int(raw.get("num_experts_per_tok", 1)), int(raw.get("moe_intermediate_size", intermediate)),
                   bool(raw.get("norm_topk_prob", model_type == "qwen3_moe")),
                   int(raw.get("shared_expert_intermediate_size", 0)) if model_type == "qwen2_moe" else 0, sparse)


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a transformers config that the model code and the KV cache need."""

    path: str
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]
    config_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoEConfig | None = None

    def shard(self, tensor_parallel_size: int) -> "ModelConfig":
        """One rank's part under tensor parallelism: attention heads, KV heads, the MLP's and the
        experts' intermediate widths split evenly (the vocabulary is padded instead)."""
        tp = tensor_parallel_size
        if tp == 1:
            return self
        widths = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                  "intermediate_size": self.intermediate_size}
        if self.moe is not None:
            widths["moe_intermediate_size"] = self.moe.expert_intermediate_size
            widths["shared_expert_intermediate_size"] = self.moe.shared_expert_intermediate_size
        for name, value in widths.items():
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name}={value}")
        moe = self.moe and replace(self.moe, expert_intermediate_size=self.moe.expert_intermediate_size // tp,
                                   shared_expert_intermediate_size=self.moe.shared_expert_intermediate_size // tp)
        return replace(self, num_heads=self.num_heads // tp, num_kv_heads=self.num_kv_heads // tp,
                       intermediate_size=self.intermediate_size // tp, moe=moe)

    @property
    def family(self) -> str:
        """The attention-and-MLP family the model code follows (qwen2_moe attends like qwen2)."""
        return self.model_type.removesuffix("_moe")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """From a model folder's config.json, or from a GGUF file's metadata."""
        from pagedllm.gguf import is_gguf, open_gguf
        from pagedllm.gguf.config import hf_config

        if is_gguf(path):
            return cls.from_dict(hf_config(open_gguf(path)), str(path))
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"model folder {str(path)!r} does not exist or is not a directory")
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"model folder {str(path)!r} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{config_file} must hold a JSON object")
        return cls.from_dict(raw, str(folder))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "") -> "ModelConfig":
        architecture = _architecture(raw)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            intermediate = int(raw["intermediate_size"])
            vocab = int(raw["vocab_size"])
        except KeyError as exc:
            raise ModelLoadError(f"config.json is missing {exc.args[0]!r}") from exc
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act={act!r} is not supported (only 'silu')")
        rope_theta, rope_scaling = _rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            path=path,
            model_type=model_type,
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=intermediate,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(raw.get("attention_bias", False)),
            o_bias=model_type == "llama" and bool(raw.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_windows=_sliding_windows(raw, model_type, num_layers),
            config_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            moe=MoEConfig.from_dict(raw, model_type, num_layers, intermediate),
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    if not archs and raw.get("model_type") in by_type:
        return by_type[raw["model_type"]]
    named = archs or [raw.get("model_type")]
    raise ModelLoadError(
        f"unknown architecture {named!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Normalise transformers ≥ 5 `rope_parameters` and the older `rope_theta`/`rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {}) or None
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"rope_type={rope_type!r} is not supported (default, linear, llama3)")
        drop = {"rope_theta", "type"}
        scaling = None if rope_type == "default" else {**{k: v for k, v in scaling.items() if k not in drop}, "rope_type": rope_type}
    return theta, scaling


def _sliding_windows(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if model_type in ("mistral", "mixtral"):
        return (int(window) if window else None,) * num_layers
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and raw.get("use_sliding_window") and window:
        kinds = raw.get("layer_types") or ["sliding_attention"] * num_layers
        return tuple(int(window) if k == "sliding_attention" else None for k in kinds)
    return (None,) * num_layers


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
    preemption_policy: str = "fcfs"
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
    kv_cache_memory_fraction: float = 0.25
    # Split the model across this many processes on this host (gloo on CPU, NCCL on CUDA).
    tensor_parallel_size: int = 1
    # Layer-wise KV offload: the pool lives in host memory, the device holds two layers' buffers
    # of `kv_offload_device_memory` bytes in all (default: two layers of the whole pool).
    kv_offload: bool = False
    kv_offload_device_memory: int | None = None
    # {"model": DIR, "num_speculative_tokens": k} or {"method": "ngram", ...}; JSON text from the CLI
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Greedy decode steps per engine step when every sequence of a step is a plain greedy decode
    # (multi-step scheduling, engine/multi_step.py); needs the fused decode step, else 1.
    num_scheduler_steps: int = 1
    # CUDA graphs for decode steps (worker/cuda_graphs.py) unless this is set (vLLM's name)
    enforce_eager: bool = False
    # CUDA: the share of the GPU's memory the engine may use; the KV pool gets what the weights
    # and a profiling forward at the largest batch leave of it (vLLM's name and default)
    gpu_memory_utilization: float = 0.9
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
        if self.preemption_policy not in ("fcfs", "priority", "shortest_remaining"):
            raise ValueError(
                "preemption_policy must be 'fcfs', 'priority' or 'shortest_remaining', "
                f"got {self.preemption_policy!r}"
            )
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
        if self.quantization == "q4" and self.tensor_parallel_size > 1:
            raise ValueError("quantization='q4' is not supported with tensor_parallel_size > 1")
        if not 0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.9]")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("num_scheduler_steps", self.num_scheduler_steps)
        spec = self.speculative_config
        if self.num_scheduler_steps > 1 and spec is not None and not (spec.uses_draft_model and spec.fused_cycles):
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
