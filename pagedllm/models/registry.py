"""Which model class serves a config: one module per architecture family."""
from __future__ import annotations

from pagedllm.config import ModelConfig
from pagedllm.models.llama import CausalLM
from pagedllm.models.moe import MoECausalLM


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """Llama, Mistral, Qwen2 and Qwen3 (dense); Mixtral, Qwen2-MoE and Qwen3-MoE (experts)."""
    return MoECausalLM if cfg.moe is not None else CausalLM
