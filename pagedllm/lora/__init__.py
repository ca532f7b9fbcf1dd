"""Serving LoRA adapters: requests that name an adapter, the weights the engine keeps for them, and
the per-row low-rank delta the model adds (docs/serving.md, "LoRA adapters")."""
from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
