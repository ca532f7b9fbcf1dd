"""A GGUF file as the HF folder transformers dequantizes from it (`from_pretrained(...,
gguf_file=...)`, fp32), for baselines that cannot read GGUF blocks (transformers' generate over
a folder, vLLM's CPU backend): the same weights, written once into the temp dir."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch


def dequantized_folder(gguf: Path) -> Path:
    """The HF folder transformers writes from the GGUF file (fp32), kept in the temp dir by the
    file's name, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"pagedllm-bench-{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized: saved as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(partial)
    os.replace(partial, folder)
    return folder
