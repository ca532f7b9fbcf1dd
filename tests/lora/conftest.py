"""Fixtures for the LoRA serving tests: a tiny base, three PEFT adapters (random A and B), one our
fine-tuner wrote (tests/lora_adapters.py), and a GGUF base."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_files import write_gguf  # noqa: E402
from lora_adapters import PEFT_ADAPTERS, make_finetuner_adapter, make_peft_adapter  # noqa: E402
from tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("lora-base") / "llama", "llama")


@pytest.fixture(scope="session")
def adapters(lora_base, tmp_path_factory) -> dict[str, Path]:
    """name -> adapter folder for lora_base: the PEFT ones and "finetuned"."""
    root = tmp_path_factory.mktemp("lora-adapters")
    made = {name: make_peft_adapter(lora_base, root / name, r, a, t, seed)
            for seed, (name, (r, a, t)) in enumerate(PEFT_ADAPTERS.items())}
    made["finetuned"] = make_finetuner_adapter(lora_base, root / "finetuned")
    return made


@pytest.fixture(scope="session")
def gguf_base(tmp_path_factory) -> tuple[Path, Path]:
    """(GGUF file with Q4_1 blocks, the HF folder it was written from)."""
    root = tmp_path_factory.mktemp("lora-gguf")
    hf = build_model(root / "hf", "llama")
    return write_gguf(hf, root / "Q4_1.gguf", "llama", "Q4_1"), hf
