"""The base model of a fine-tune: its shape, weights, tokenizer and chat template, from a Hugging
Face folder, a GGUF file or the default model (`@default`).

The serving side already reads all three kinds (config/model.py, models/loader.py, gguf/): the
same readers fill the trainer's model here, so a GGUF is dequantized by the project's own reader
with its llama.cpp row permutation undone, exactly as the engine loads it. The shape fields of
model_config come from the base; one the job sets explicitly to another value is an error naming
it (a job that says hidden_size = 512 for a 576-wide model is wrong, not a request to resize).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from pagedllm.config.model import ModelConfig
from pagedllm.load_errors import ModelLoadError
from pagedllm.training.config import DEFAULT_BASE_MODEL, ConfigError, ModelShapeConfig, TrainingJob

BASE_FIELD = "finetune_config.base_model"
_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def base_model_path(name: str) -> Path:
    """The file or folder `name` stands for (`@default` is the installed SmolLM2-135M-Instruct GGUF)."""
    if name == DEFAULT_BASE_MODEL:
        from pagedllm.paths import DefaultModelMissing, default_model

        try:
            return default_model()
        except DefaultModelMissing as exc:
            raise ConfigError(BASE_FIELD, str(exc)) from exc
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(BASE_FIELD, f"no such model folder or file: {name}")
    return path


def base_config(name: str) -> ModelConfig:
    try:
        return ModelConfig.from_pretrained(base_model_path(name))
    except ModelLoadError as exc:
        raise ConfigError(BASE_FIELD, str(exc)) from exc


def shape_of(cfg: ModelConfig) -> dict:
    """model_config's fields for a served model's config; a feature the trainer's model lacks is a ConfigError."""
    architecture = _ARCHITECTURES.get(cfg.model_type)
    if architecture is None or cfg.moe is not None:
        raise ConfigError(BASE_FIELD, f"fine-tuning a {cfg.model_type} model is not supported (llama, mistral, qwen2, qwen3)")
    if cfg.rope_scaling is not None:
        raise ConfigError(BASE_FIELD, f"rope scaling {cfg.rope_scaling.get('rope_type')!r} is not supported by the trainer yet")
    if cfg.o_bias or cfg.mlp_bias or (cfg.qkv_bias and architecture != "qwen2"):
        raise ConfigError(BASE_FIELD, "attention/MLP biases are only supported on qwen2's q/k/v projections")
    windows = {w for w in cfg.sliding_windows if w is not None}
    if windows and architecture != "mistral":
        raise ConfigError(BASE_FIELD, "sliding-window attention is only supported for mistral")
    return {
        "architecture": architecture,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "sliding_window": next(iter(windows)) if windows else None,
    }


def apply_base_model(job: TrainingJob) -> TrainingJob:
    """The job with model_config read from its base model; an explicit field that disagrees is a ConfigError."""
    assert job.finetune is not None
    shape = shape_of(base_config(job.finetune.base_model))
    given = job.model.model_fields_set
    for name, value in shape.items():
        mine = getattr(job.model, name)
        if name == "head_dim" and mine is None:
            continue
        if name in given and mine != value:
            raise ConfigError(f"model_config.{name}", f"{mine!r} conflicts with the base model's {value!r} "
                                                      f"({job.finetune.base_model}); leave it out")
    return job.model_copy(update={"model": ModelShapeConfig(**{**job.model.model_dump(), **shape})})


def base_tensors(name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) of every weight of the base model, one at a time."""
    from pagedllm.models.loader import checkpoint_tensors

    for key, tensor, _ in checkpoint_tensors(base_model_path(name)):
        yield key, tensor.to(torch.float32)


def load_base_weights(model: torch.nn.Module, name: str) -> None:
    """Fill every parameter of `model` (a TrainingCausalLM of the base's shape) from the base, by name.
    A missing or surplus tensor is an error: training a half-loaded model would be silently wrong."""
    params = dict(model.named_parameters())
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_word_embeddings
    pending = set(params) - ({"lm_head.weight"} if tied else set())
    for key, tensor in base_tensors(name):
        if key == "lm_head.weight" and tied:
            continue
        if key not in params:
            raise ModelLoadError(f"{name}: tensor {key!r} has no place in the trainer's model")
        if tuple(params[key].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{name}: {key} has shape {tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
        with torch.no_grad():
            params[key].copy_(tensor)
        pending.discard(key)
    if pending:
        raise ModelLoadError(f"{name} lacks weights for {sorted(pending)[:8]}")


def base_tokenizer(name: str):
    """The base model's transformers fast tokenizer (a GGUF's built from its metadata), chat template included."""
    from pagedllm.engine.llm_engine import load_tokenizer

    tokenizer = load_tokenizer(str(base_model_path(name)))
    if tokenizer is None:
        raise ConfigError(BASE_FIELD, f"{name} has no tokenizer")
    return tokenizer


def write_tokenizer(tokenizer, out: Path) -> Path:
    """tokenizer.json + tokenizer_config.json (special tokens and the chat template inline), the two
    files every tokenizer folder of this project has (training/tokenizer.py's tokenizer_files)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token or tokenizer.eos_token,
        "unk_token": tokenizer.unk_token,
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
        "add_eos_token": bool(getattr(tokenizer, "add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
