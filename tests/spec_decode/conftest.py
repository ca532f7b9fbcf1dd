"""Draft models for speculative decoding tests: the target cut down to its first layer (same
vocabulary, embeddings and head), so proposals are often but not always right."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import load_reference


def truncated_copy(target: Path, folder: Path, num_layers: int = 1) -> Path:
    model = load_reference(target)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:num_layers])
    model.config.num_hidden_layers = num_layers
    if hasattr(model.config, "layer_types") and model.config.layer_types:
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def draft_dir(model_dir, tmp_path_factory):
    built: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = truncated_copy(model_dir(arch), tmp_path_factory.mktemp(f"draft-{arch}"))
        return built[arch]

    return get
