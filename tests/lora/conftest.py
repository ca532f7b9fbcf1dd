"""Adapters for the LoRA serving tests: three PEFT made (random A and B), one our fine-tuner wrote,
and bad ones; the reference is transformers + PEFT on the same base folder."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_files import write_gguf  # noqa: E402
from tiny_models import build_model, load_reference  # noqa: E402

# (name, rank, alpha, targets): every projection a LoRA may target is covered by one of them
PEFT_ADAPTERS = {
    "attn": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"]),
    "all": (2, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_peft_adapter(base: Path, out: Path, rank: int, alpha: int, targets: list[str], seed: int,
                      reference_model=None) -> Path:
    """A PEFT adapter with random A and B (init_lora_weights=False): a zero B would test nothing."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = reference_model if reference_model is not None else load_reference(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random B is small next to a tiny model's weights: make the change visible
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(str(out), save_embedding_layers=False)
    return out


def make_finetuner_adapter(base: Path, out: Path) -> Path:
    """An adapter written by our fine-tuner's code (training/finetune.py), its B randomized."""
    from pagedllm.training.config import FinetuneConfig, parse_job, resolve
    from pagedllm.training.finetune import build_finetune_model, write_adapter
    from pagedllm.training.lora import adapter_state
    from pagedllm.training.pretrained import apply_base_model

    job = parse_job({"finetune_config": {"base_model": str(base)}, "memory_config": {"zero_stage": 0},
                     "data_config": {"dataset_path": "x.jsonl", "sequence_length": 16, "global_batch_size": 1,
                                     "micro_batch_size": 1}})
    ft = FinetuneConfig(base_model=str(base), method="lora", lora_rank=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    torch.manual_seed(7)
    model = build_finetune_model(resolve(apply_base_model(job), 1).model, ft)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return write_adapter(adapter_state(model), ft, out)


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
