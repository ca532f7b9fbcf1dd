"""GGUF files (llama.cpp's format) served directly: config, tokenizer and weights from one file."""
from pagedllm.gguf.file import GGUFModel, is_gguf, open_gguf

__all__ = ["GGUFModel", "is_gguf", "open_gguf"]
