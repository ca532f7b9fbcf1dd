"""LoRA adapters for tests: made by PEFT (random A and B) or by our fine-tuner, for a tiny base folder;
and the reference: transformers + PEFT greedy tokens."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import load_reference

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


def peft_greedy(model_factory, adapter: Path | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, with the PEFT adapter at `adapter` (None: the base)."""
    from peft import PeftModel

    model = model_factory()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out
