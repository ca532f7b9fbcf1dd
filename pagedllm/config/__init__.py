"""Configuration, built once at the entry point and passed down: the engine's arguments
(engine.py), a model's config.json (model.py) and speculative decoding's settings (speculative.py)."""
from pagedllm.config.engine import EngineConfig, available_memory_bytes, resolve_dtype
from pagedllm.config.model import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError, MoEConfig
from pagedllm.config.speculative import SpeculativeConfig

__all__ = ["EngineConfig", "ModelConfig", "ModelLoadError", "MoEConfig", "SpeculativeConfig", "SUPPORTED_ARCHITECTURES",
           "available_memory_bytes", "resolve_dtype"]
