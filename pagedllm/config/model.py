"""A model's configuration, read from a Hugging Face `config.json` or a GGUF file.

`ModelConfig` accepts both the transformers >= 5 spelling (`rope_parameters`) and the older
`rope_theta` + `rope_scaling`, or a GGUF file's metadata; a folder that is missing, incomplete or of an unsupported
architecture raises `ModelLoadError` naming what is wrong.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagedllm.load_errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


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
        head_dim = int(raw.get("head_dim") or hidden // max(num_heads, 1))
        max_position = int(raw.get("max_position_embeddings", 2048))
        _check_sizes(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                     num_key_value_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                     max_position_embeddings=max_position)
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
        _check_special_ids(vocab, eos_token_id=eos_ids, bos_token_id=(raw.get("bos_token_id"),))
        return cls(
            path=path,
            model_type=model_type,
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position,
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


# Far above any released model, far below what would exhaust memory by themselves: a config past
# them is damaged or hostile, and is refused before anything is built from it.
SIZE_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 10,
               "num_key_value_heads": 1 << 10, "head_dim": 1 << 12, "intermediate_size": 1 << 18,
               "max_position_embeddings": 1 << 24}


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not 1 <= value <= SIZE_LIMITS[name]:
            raise ModelLoadError(f"{name}={value} is outside [1, {SIZE_LIMITS[name]}]")


def _check_special_ids(vocab: int, **ids: tuple[Any, ...]) -> None:
    """An end-of-sequence id outside the vocabulary can never be sampled and once indexed past the
    logits when a request set min_tokens; a file that names one is broken."""
    for name, values in ids.items():
        for value in values:
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
                raise ModelLoadError(f"{name} {value!r} is outside the vocabulary [0, {vocab})")


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
