"""Tiny randomly initialised Hugging Face model folders for tests, built with transformers itself.

`initializer_range=0.1` keeps logits far from flat, so greedy decoding has few float near-ties.
A byte-level BPE tokenizer is trained on Python standard-library source (present on every
machine) so string prompts, detokenization and chat templates are exercised for real.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from pagedllm.training.tokenizer import CHAT_TEMPLATE

VOCAB = 384


def stdlib_text(max_chars: int = 400_000) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for name in ("textwrap.py", "string.py", "heapq.py", "bisect.py", "shlex.py", "fnmatch.py", "glob.py", "calendar.py", "difflib.py", "argparse.py"):
        text = (stdlib / name).read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(parts)[:max_chars]


def build_tokenizer(folder: Path, vocab_size: int = VOCAB, chat_template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([stdlib_text()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def model_config(arch: str, **overrides):
    from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":  # Llama 3.1 rope scaling, tied embeddings
        common.update(tie_word_embeddings=True)
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":
        return MistralConfig(**{**common, "sliding_window": 48})
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{"head_dim": 32, **common})
    # Mixture-of-experts: 4 experts, top 2; Qwen3-MoE keeps a dense MLP in its second layer
    # and renormalises the kept router weights, Qwen2-MoE adds a gated shared expert.
    if arch == "mixtral":
        return MixtralConfig(**{**common, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{**common, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                 "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 32})
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**{**common, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                 "shared_expert_intermediate_size": 96, "norm_topk_prob": False})
    raise ValueError(arch)


def build_model(folder: Path, arch: str = "llama", seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """Save a tiny random `arch` model (and tokenizer) into `folder`; returns the folder."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(arch, **overrides), dtype=torch.float32)
    model.save_pretrained(folder)
    if tokenizer:
        build_tokenizer(folder)
    return folder


def load_reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
