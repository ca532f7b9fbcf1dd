"""The trainable model against transformers' own classes, and its pieces (MoE, checkpointing, stage cuts)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pagedllm.training.config import ModelShapeConfig
from pagedllm.training.export import write_hf_folder
from pagedllm.training.model import SparseMoE, build_model, count_parameters, num_params
from pagedllm.training.parallel import apply_activation_checkpointing
from pagedllm.training.pipeline import layer_split, stage_module

from .helpers import VOCAB

SHAPES = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen3": {"head_dim": 16, "rms_norm_eps": 1e-6},
    "moe": {"num_experts": 4, "num_experts_per_token": 2},
}


def tiny_config(arch: str, **extra) -> ModelShapeConfig:
    shape = dict(architecture=arch, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                 intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64)
    return ModelShapeConfig(**{**shape, **SHAPES[arch], **extra})


@pytest.mark.parametrize("arch, hf_type, hf_class", [
    ("llama", "llama", "LlamaForCausalLM"),
    ("mistral", "mistral", "MistralForCausalLM"),
    ("qwen3", "qwen3", "Qwen3ForCausalLM"),
    ("moe", "mixtral", "MixtralForCausalLM"),
])
def test_logits_equal_transformers_on_the_exported_folder(arch, hf_type, hf_class, tiny_paths, tmp_path):
    """Export is a plain state-dict write: transformers loads it with no missing/unexpected keys and
    computes the same logits (mistral's window 8 < 20 tokens exercises the sliding-window mask)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch)
    model = build_model(cfg, seed=3)
    assert count_parameters(model) == num_params(cfg)
    folder = write_hf_folder(model.state_dict(), cfg, tiny_paths["tokenizer"], tmp_path / arch)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == hf_type and config["architectures"] == [hf_class]
    hf, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(hf).__name__ == hf_class
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_safetensors_use_hugging_face_names(tiny_paths, tmp_path):
    folder = write_hf_folder(build_model(tiny_config("moe"), 0).state_dict(), tiny_config("moe"),
                             tiny_paths["tokenizer"], tmp_path / "moe")
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.post_attention_layernorm.weight"} <= names


def test_tied_embeddings_export_without_lm_head(tiny_paths, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama", tie_word_embeddings=True)
    model = build_model(cfg, seed=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    folder = write_hf_folder(model.state_dict(), cfg, tiny_paths["tokenizer"], tmp_path / "tied")
    hf = AutoModelForCausalLM.from_pretrained(folder)
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_moe_balance_loss_and_every_expert_gets_a_gradient():
    cfg = tiny_config("moe")
    moe = SparseMoE(cfg)
    x = torch.randn(3, 5, cfg.hidden_size)
    out = moe(x)
    probs = torch.softmax(moe.gate(x.reshape(-1, cfg.hidden_size)), dim=-1).detach()
    top = probs.topk(2, dim=-1).indices
    fraction = torch.stack([(top == e).float().sum() for e in range(4)]) / top.numel()
    assert moe.aux_loss.detach().item() == pytest.approx(4 * float((fraction * probs.mean(0)).sum()), rel=1e-5)
    (out.sum() + moe.aux_loss).backward()
    assert all(expert.w1.weight.grad is not None for expert in moe.experts)


@pytest.mark.parametrize("granularity", ["FULL", "SELECTIVE"])
def test_activation_checkpointing_keeps_gradients(granularity):
    cfg = tiny_config("llama")
    plain, ckpt = build_model(cfg, 5), build_model(cfg, 5)
    apply_activation_checkpointing(ckpt, granularity)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (plain, ckpt):
        m(tokens).logsumexp(-1).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]


def test_pipeline_stages_keep_global_layer_names():
    assert [list(r) for r in layer_split(5, 2)] == [[0, 1, 2], [3, 4]]
    model = build_model(tiny_config("llama", num_layers=4), 0)
    first, last = stage_module(model, 0, 2), stage_module(model, 1, 2)
    assert list(first.model.layers.keys()) == ["0", "1"] and list(last.model.layers.keys()) == ["2", "3"]
    assert first.lm_head is None and first.model.norm is None and last.model.embed_tokens is None
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    tokens = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), model(tokens))


def test_attention_dropout_applies_while_training_only():
    """Dropout draws masks in train mode (two forwards differ) and is off in eval mode (equal to
    the same weights without dropout)."""
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    dropped, plain = build_model(tiny_config("llama", attention_dropout=0.5), seed=1), build_model(tiny_config("llama"), seed=1)
    assert not torch.equal(dropped(tokens), dropped(tokens))
    dropped.eval()
    torch.testing.assert_close(dropped(tokens), plain(tokens), rtol=0, atol=0)


def test_logits_of_kept_positions_and_their_loss_equal_the_full_outputs():
    """A fine-tune's step asks for the trained positions' logits only: the same rows of the full
    logits, and the loss over them (with its gradients) equals cross-entropy over all positions
    with the rest ignored."""
    cfg = tiny_config("llama", tie_word_embeddings=True)
    full, kept = build_model(cfg, 5), build_model(cfg, 5)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    segments = torch.tensor([[0] * 6 + [1] * 10, [0] * 12 + [-1] * 4])
    labels = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    labels[0, :3] = labels[1, 12:] = -100
    keep = labels != -100
    logits = full(tokens, segments)
    torch.testing.assert_close(kept(tokens, segments, keep), logits[keep], rtol=1e-5, atol=1e-6)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    torch.nn.functional.cross_entropy(kept(tokens, segments, keep), labels[keep]).backward()
    for (name, a), (_, b) in zip(full.named_parameters(), kept.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
