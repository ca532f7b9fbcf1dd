"""The model of a fine-tune: the trainer's model filled from the base, then LoRA or QLoRA applied.

full: every parameter trains (the trainer's usual path, from pretrained weights instead of random).
lora: the base is frozen in float32, pairs on finetune_config.target_modules train.
qlora: as lora, but the adapted layers keep the base weights as blocks (training/qlora.py): a GGUF's
own Q4_0/Q4_1/Q8_0 blocks (other block types converted to the nearest kept type, as the engine
does), a folder's weights quantized to Q4_1.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.adapters.peft_format import LoraSettings, load_adapter, save_adapter
from pagedllm.training.config import FinetuneConfig, FinetuneMethod, ModelShapeConfig
from pagedllm.training.lora import apply_lora, load_adapter_state
from pagedllm.training.model import TrainingCausalLM
from pagedllm.training.pretrained import base_model_path, load_base_weights


def lora_settings(ft: FinetuneConfig) -> LoraSettings:
    return LoraSettings(ft.lora_rank, ft.lora_alpha, ft.lora_dropout, tuple(ft.target_modules))


def _file_blocks(base: str) -> dict:
    from pagedllm.gguf import is_gguf, open_gguf
    from pagedllm.gguf.weights import blocks

    path = base_model_path(base)
    return dict(blocks(open_gguf(path))) if is_gguf(path) else {}


def build_finetune_model(shape: ModelShapeConfig, ft: FinetuneConfig) -> TrainingCausalLM:
    """The base model of `ft` with its method's trainable parameters (LoRA pairs start as a no-op)."""
    model = TrainingCausalLM(shape)
    load_base_weights(model, ft.base_model)
    if ft.method is FinetuneMethod.LORA:
        apply_lora(model, lora_settings(ft))
    elif ft.method is FinetuneMethod.QLORA:
        from pagedllm.training.qlora import qlora_layer_factory

        apply_lora(model, lora_settings(ft), qlora_layer_factory(_file_blocks(ft.base_model)))
    return model


def write_adapter(tensors: dict[str, torch.Tensor], ft: FinetuneConfig, out: str | Path) -> Path:
    """An adapter (lora.adapter_state) as a PEFT folder; the base is named by its resolved path (what export --merge reads)."""
    return save_adapter(out, lora_settings(ft), str(base_model_path(ft.base_model).resolve()), tensors)


def model_with_adapter(shape: ModelShapeConfig, base: str, adapter_dir: str | Path, quantized: bool = False) -> TrainingCausalLM:
    """The base with a PEFT adapter folder applied (ours or one PEFT trained), for inference or merging."""
    settings, _, tensors = load_adapter(adapter_dir)
    method = FinetuneMethod.QLORA if quantized else FinetuneMethod.LORA
    ft = FinetuneConfig(base_model=base, method=method, lora_rank=settings.rank, lora_alpha=settings.alpha,
                        target_modules=list(settings.target_modules))
    model = build_finetune_model(shape, ft)
    if settings.use_rslora:  # the pairs were built with alpha / rank
        for module in model.modules():
            if hasattr(module, "scaling") and hasattr(module, "lora_A"):
                module.scaling = settings.scaling
    load_adapter_state(model, tensors)
    return model.eval()

