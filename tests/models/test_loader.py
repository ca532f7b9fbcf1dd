"""Loading Hugging Face folders: sharded checkpoints, both rope spellings, mismatches."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig, ModelLoadError
from tiny_models import build_tokenizer, load_reference


def test_sharded_checkpoint_loads_and_matches(model_dir, tmp_path):
    reference = load_reference(model_dir("qwen2"))
    folder = tmp_path / "sharded"
    reference.save_pretrained(folder, max_shard_size="40KB")
    build_tokenizer(folder)
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    prompt = [5, 9, 40, 33, 12]
    ours = LLM(str(folder)).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    reference.generation_config.eos_token_id = None
    theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2)[0, 5:].tolist()
    assert ours.outputs[0].token_ids == theirs


def test_old_and_new_rope_spellings_agree():
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=100)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {**scaling, "rope_type": "llama3"}})
    new = ModelConfig.from_dict({**base, "rope_parameters": {**scaling, "rope_type": "llama3", "rope_theta": 5e5}})
    legacy_key = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {**scaling, "type": "llama3"}})
    assert old.rope_theta == new.rope_theta == legacy_key.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == legacy_key.rope_scaling
    with pytest.raises(ModelLoadError, match="rope_type='yarn'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_missing_or_misshapen_weights_are_named(model_dir, tmp_path):
    source = model_dir("llama")
    for name, mutate, message in [
        ("missing", lambda t: t.pop("model.norm.weight"), "lacks weights for \\['model.norm.weight'\\]"),
        ("misshapen", lambda t: t.update({"model.norm.weight": torch.ones(3)}), "model.norm.weight .* has shape \\(3,\\)"),
        ("extra", lambda t: t.update({"model.layers.0.mystery.weight": torch.ones(3)}), "no place for"),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((source / "config.json").read_text())
        tensors = load_file(source / "model.safetensors")
        mutate(tensors)
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(ModelLoadError, match=message):
            LLM(str(folder))


def test_folder_without_tokenizer_takes_token_ids(model_dir, tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((model_dir("llama") / name).read_bytes())
    llm = LLM(str(folder))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate(["text"], use_tqdm=False)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
