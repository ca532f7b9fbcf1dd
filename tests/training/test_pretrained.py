"""A fine-tune's starting point: the trainer's model filled from a pretrained checkpoint gives
transformers' logits on the same checkpoint (HF folders of each family, and the SmolLM2 GGUF)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedllm.training.config import ConfigError, parse_job, resolve
from pagedllm.training.pretrained import apply_base_model
from pagedllm.training.model import TrainingCausalLM
from pagedllm.training.pretrained import base_tokenizer, load_base_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import build_model, load_reference  # noqa: E402


def finetune_job(base: str | Path, **model_config) -> dict:
    return {"model_config": model_config, "finetune_config": {"base_model": str(base), "method": "full"},
            "data_config": {"dataset_path": "unused.jsonl", "sequence_length": 32, "global_batch_size": 2, "micro_batch_size": 1},
            "memory_config": {"zero_stage": 0}}


def trainer_model(base: str | Path) -> TrainingCausalLM:
    job = resolve(apply_base_model(parse_job(finetune_job(base))), 1)
    model = TrainingCausalLM(job.model)
    load_base_weights(model, str(base))
    return model.eval()


@pytest.mark.parametrize("arch, overrides", [("llama", {"tie_word_embeddings": True}), ("mistral", {}), ("qwen2", {}),
                                             ("qwen3", {})])
def test_logits_equal_transformers_on_a_folder(tmp_path, arch, overrides):
    folder = build_model(tmp_path / arch, arch, **overrides)
    ids = torch.randint(0, 384, (2, 60), generator=torch.Generator().manual_seed(0))  # > mistral's window 48
    with torch.no_grad():
        ours = trainer_model(folder)(ids)
        theirs = load_reference(folder)(ids).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_shape_comes_from_the_base_and_a_conflicting_field_is_named(tmp_path):
    folder = build_model(tmp_path / "llama", "llama")
    job = resolve(apply_base_model(parse_job(finetune_job(folder))), 1)
    assert (job.model.hidden_size, job.model.num_layers, job.model.num_kv_heads, job.model.vocab_size) == (64, 2, 2, 384)
    assert resolve(apply_base_model(parse_job(finetune_job(folder, hidden_size=64))), 1).model.hidden_size == 64  # agreeing is fine
    with pytest.raises(ConfigError) as err:
        resolve(apply_base_model(parse_job(finetune_job(folder, hidden_size=512))), 1)
    assert err.value.field == "model_config.hidden_size" and "64" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve(apply_base_model(parse_job(finetune_job(tmp_path / "missing"))), 1)
    assert err.value.field == "finetune_config.base_model"


def test_packed_segments_equal_separate_sequences(tmp_path):
    """Two examples packed in one row, attention kept within each: each one's logits equal running it alone."""
    model = trainer_model(build_model(tmp_path / "llama", "llama"))
    a, b = torch.randint(0, 384, (1, 7)), torch.randint(0, 384, (1, 9))
    segments = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), segments)
        torch.testing.assert_close(packed[:, :7], model(a), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(packed[:, 7:], model(b), atol=1e-5, rtol=1e-4)


def test_smollm2_gguf_logits_equal_transformers():
    """The default model, dequantized by our GGUF reader (q/k rows unpermuted, tied embeddings),
    against transformers' own GGUF loader on the same file."""
    from transformers import AutoModelForCausalLM

    from pagedllm.paths import default_model

    path = default_model()
    tokenizer = base_tokenizer("@default")
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)])
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(ids).logits
        del reference
        ours = trainer_model("@default")(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3)
    assert tokenizer.decode(ours[0, -1].argmax()) == tokenizer.decode(theirs[0, -1].argmax())
