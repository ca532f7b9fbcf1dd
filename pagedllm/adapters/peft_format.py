"""LoRA adapters in Hugging Face PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

A PEFT LoRA adapter is a set of low-rank pairs for named linear layers of a base model:
W' = W + scaling * B @ A, with A [rank, in] and B [out, rank], scaling = lora_alpha / rank
(lora_alpha / sqrt(rank) with use_rslora). PEFT names the tensors after the wrapped model's
modules: `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight` (the adapter's name,
"default", is dropped when saving). Our module paths are Hugging Face's (training/model.py), so
the names map one to one.

This module knows only the files and the names, not the trainer: the trainer writes its adapters
through it, `pagedllm export --merge` reads them back, and serving adapters can read the same files.
Features of PEFT's format this does not implement (DoRA, per-module rank or alpha patterns,
biases, fan_in_fan_out layers, modules_to_save) are refused by name, never half-loaded.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterFormatError(ValueError):
    """An adapter folder that is not a PEFT LoRA adapter we can load; the message says which field."""


@dataclass(frozen=True)
class LoraSettings:
    """What an adapter's tensors need to be applied: rank, alpha, dropout (training only), targets."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def adapter_config(settings: LoraSettings, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for a causal LM's LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(settings.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": settings.use_rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(out: str | Path, settings: LoraSettings, base_model: str, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `tensors` (our names: `model.layers.0.self_attn.q_proj.lora_A.weight`, ...) as a PEFT adapter folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    named = {PREFIX + name: t.detach().to(torch.float32).contiguous().clone() for name, t in tensors.items()}
    save_file(named, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(settings, base_model), indent=2) + "\n")
    return out


def _settings(config: dict) -> LoraSettings:
    if config.get("peft_type") != "LORA":
        raise AdapterFormatError(f"peft_type: {config.get('peft_type')!r} is not supported (only 'LORA')")
    for field, ok in (("use_dora", not config.get("use_dora")), ("fan_in_fan_out", not config.get("fan_in_fan_out")),
                      ("bias", config.get("bias", "none") == "none"), ("rank_pattern", not config.get("rank_pattern")),
                      ("alpha_pattern", not config.get("alpha_pattern")), ("modules_to_save", not config.get("modules_to_save"))):
        if not ok:
            raise AdapterFormatError(f"{field}: {config.get(field)!r} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    try:
        return LoraSettings(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout") or 0.0),
                            tuple(targets), bool(config.get("use_rslora", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterFormatError(f"r / lora_alpha: missing or not numbers ({exc})") from None


def _our_name(key: str) -> str:
    if not key.startswith(PREFIX):
        raise AdapterFormatError(f"{WEIGHTS_FILE}: tensor {key!r} does not start with {PREFIX!r}")
    name = key[len(PREFIX):]
    for part in ("lora_A", "lora_B"):  # some writers keep the adapter's name: lora_A.default.weight
        name = name.replace(f".{part}.default.weight", f".{part}.weight")
    if not (name.endswith(".lora_A.weight") or name.endswith(".lora_B.weight")):
        raise AdapterFormatError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A or B matrix")
    return name


def load_adapter(folder: str | Path) -> tuple[LoraSettings, str | None, dict[str, torch.Tensor]]:
    """(settings, base_model_name_or_path, tensors under our names) of a PEFT LoRA adapter folder.
    The modules adapted are the ones the tensors name (each must have both A and B)."""
    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise AdapterFormatError(f"{folder} has no {name} (a PEFT adapter folder has {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterFormatError(f"{folder / CONFIG_FILE} is not valid JSON: {exc}") from None
    settings = _settings(config)
    tensors = {_our_name(k): v.to(torch.float32) for k, v in load_file(str(folder / WEIGHTS_FILE)).items()}
    modules = {name.rsplit(".", 2)[0] for name in tensors}
    for module in modules:
        a, b = tensors.get(f"{module}.lora_A.weight"), tensors.get(f"{module}.lora_B.weight")
        if a is None or b is None or a.shape[0] != b.shape[1]:
            raise AdapterFormatError(f"{module}: needs lora_A [r, in] and lora_B [out, r] of one rank")
    leaves = tuple(sorted({m.rsplit(".", 1)[-1] for m in modules}))
    settings = LoraSettings(settings.rank, settings.alpha, settings.dropout, leaves, settings.use_rslora)
    return settings, config.get("base_model_name_or_path"), tensors
