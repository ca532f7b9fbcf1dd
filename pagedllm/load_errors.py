"""The error a model that cannot be loaded raises, below both the configuration and the file readers.

Why its own leaf module: the configuration reads GGUF files (pagedllm.gguf) and the GGUF readers raise
this error, so it can live in neither package without an import cycle between them.
"""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder or file that is missing, incomplete, corrupt or of an unsupported architecture."""
