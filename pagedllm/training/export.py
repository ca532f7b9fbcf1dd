"""Hugging Face model folders from a trained model or a DCP checkpoint (`pagedllm export`).

Our parameter names are Hugging Face's, so export is: gather a full state dict, write it with
safetensors, write config.json for the matching transformers class, copy the tokenizer files.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm.training.config import ModelShapeConfig, TrainingJob
from pagedllm.training.tokenizer import special_token_ids, tokenizer_config, tokenizer_files

HF_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "moe": ("mixtral", "MixtralForCausalLM"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(cfg: ModelShapeConfig, token_ids: dict[str, int | None], dtype: str = "float32") -> dict:
    """config.json for the transformers class of `cfg.architecture`, with every field our model uses."""
    model_type, class_name = HF_CLASSES[cfg.architecture]
    config = {
        "architectures": [class_name],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": token_ids.get("bos_token"),
        "eos_token_id": token_ids.get("eos_token"),
        "pad_token_id": token_ids.get("pad_token"),
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if cfg.architecture in ("mistral", "qwen2", "qwen3", "moe"):
        config["sliding_window"] = cfg.sliding_window if cfg.architecture == "mistral" else None
        config["use_sliding_window"] = False
    if cfg.architecture == "moe":
        config["num_local_experts"] = cfg.num_experts
        config["num_experts_per_tok"] = cfg.num_experts_per_token
        config["router_aux_loss_coef"] = cfg.router_aux_loss_coef
        config["output_router_logits"] = False
    return config


def write_hf_folder(state_dict: dict[str, torch.Tensor], cfg: ModelShapeConfig, tokenizer_path: str | Path,
                    out: str | Path, dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(DTYPES[dtype]).contiguous().clone() for name, t in state_dict.items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # transformers re-ties it from embed_tokens
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = special_token_ids(tokenizer_path)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, ids, dtype), indent=2) + "\n")
    generation = {"bos_token_id": ids["bos_token"], "eos_token_id": ids["eos_token"], "pad_token_id": ids["pad_token"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _copy_tokenizer(tokenizer_path, out)
    return out


def _copy_tokenizer(tokenizer_path: str | Path, out: Path) -> None:
    tokenizer_json, config_json = tokenizer_files(tokenizer_path)
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    if config_json is not None:
        shutil.copyfile(config_json, out / "tokenizer_config.json")
    else:
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def load_checkpoint_state(checkpoint: str | Path) -> tuple[TrainingJob, dict[str, torch.Tensor]]:
    """The job config and the full (unsharded) model state dict of a COMPLETE checkpoint, in this
    process. Its manifest must carry this process's signature (provenance.py) and its model files
    their recorded checksums before DCP reads any (ProvenanceError / ValueError otherwise)."""
    import torch.distributed.checkpoint as dcp

    from pagedllm.training.checkpoint import check_provenance, read_manifest, resolve_checkpoint, verify
    from pagedllm.training.model import TrainingCausalLM
    from pagedllm.training.provenance import current_key

    step_dir = resolve_checkpoint(checkpoint)
    manifest = read_manifest(step_dir)
    assert manifest is not None  # resolve_checkpoint found it
    check_provenance(step_dir, manifest, current_key())
    problems = verify(step_dir, manifest, [record.file_path for record in manifest.shards])
    if problems or not manifest.shards:
        raise ValueError(f"checkpoint {step_dir} cannot be exported: {'; '.join(problems) or 'it has no model files'}")
    job = TrainingJob.model_validate_json((step_dir / "job.json").read_text())
    if job.finetune is not None and job.finetune.adapter:  # the checkpoint holds only the adapter
        from pagedllm.training.finetune import build_finetune_model

        model = build_finetune_model(job.model, job.finetune)
        state = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    else:
        model = TrainingCausalLM(job.model)
        state = model.state_dict()
        if job.model.tie_word_embeddings:
            state.pop("lm_head.weight", None)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir / "model"), no_dist=True)
    return job, state


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """A Hugging Face folder; for a LoRA / QLoRA job's checkpoint, its PEFT adapter folder."""
    job, state = load_checkpoint_state(checkpoint)
    if job.finetune is not None and job.finetune.adapter:
        from pagedllm.training.finetune import write_adapter
        from pagedllm.training.lora import adapter_names

        return write_adapter(adapter_names(state), job.finetune, out)
    tokenizer = Path(checkpoint_tokenizer(checkpoint))
    return write_hf_folder(state, job.model, tokenizer, out, dtype)


def checkpoint_tokenizer(checkpoint: str | Path) -> Path:
    """The tokenizer copy the trainer keeps in the checkpoint folder (so export survives moves)."""
    from pagedllm.training.checkpoint import resolve_checkpoint

    return resolve_checkpoint(checkpoint).parent / "tokenizer"


def merge_adapter(adapter_dir: str | Path, out: str | Path, base: str | None = None, dtype: str = "float32") -> Path:
    """A Hugging Face model folder (config, merged weights, the base's tokenizer and chat template)
    from a PEFT adapter and its base: what `pagedllm export --merge` writes and the engine serves."""
    import tempfile

    from pagedllm.adapters.peft_format import load_adapter
    from pagedllm.training.config import ConfigError
    from pagedllm.training.finetune import model_with_adapter
    from pagedllm.training.lora import merged_state
    from pagedllm.training.pretrained import base_config, base_tokenizer, shape_of, write_tokenizer

    _, named_base, _ = load_adapter(adapter_dir)
    base = base or named_base
    if not base:
        raise ConfigError("--base", f"{adapter_dir}/adapter_config.json names no base_model_name_or_path; give --base")
    shape = ModelShapeConfig(**shape_of(base_config(base)))
    state = merged_state(model_with_adapter(shape, base, adapter_dir))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tokenizer(base_tokenizer(base), Path(tmp))
        return write_hf_folder(state, shape, tokenizer, out, dtype)
