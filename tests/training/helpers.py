"""Tiny jobs shared by the training tests and by dist_scenarios.py (which torchrun runs as a script)."""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import pickle
import shutil
import sysconfig
import uuid
from pathlib import Path

# Python standard-library sources: present on every machine, real text for the tokenizer and the model.
CORPUS_FILES = ("textwrap.py", "heapq.py", "bisect.py", "string.py", "shlex.py", "fnmatch.py", "json/decoder.py")
VOCAB = 384

BASE_JOB = {
    "job_name": "tiny",
    "seed": 7,
    "log_interval_steps": 100,
    "model_config": {
        "architecture": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
    },
    "data_config": {"sequence_length": 32, "global_batch_size": 8, "micro_batch_size": 2, "validation_split": 0.2,
                    "eval_sequences": 16},
    "optimization_config": {"total_steps": 6, "warmup_steps": 2, "learning_rate": 3e-3},
    "memory_config": {"zero_stage": 3},
    "checkpoint_config": {},
}


def write_corpus(folder: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder.mkdir(parents=True, exist_ok=True)
    for name in CORPUS_FILES:
        shutil.copyfile(stdlib / name, folder / name.replace("/", "_"))
    return folder


def tiny_job(paths: dict, checkpoint_dir: str | Path, **sections) -> dict:
    """BASE_JOB with the test's corpus/tokenizer/cache and per-section overrides, e.g.
    tiny_job(paths, dir, memory_config={"zero_stage": 1})."""
    job = copy.deepcopy(BASE_JOB)
    job["data_config"].update(dataset_path=str(paths["corpus"]), tokenizer_path=str(paths["tokenizer"]),
                              cache_dir=str(paths["cache"]))
    job["checkpoint_config"]["checkpoint_dir"] = str(checkpoint_dir)
    for section, values in sections.items():
        if isinstance(values, dict):
            job.setdefault(section, {}).update(values)
        else:
            job[section] = values
    return job


class _Payload:
    """What a planted pickle would run: here, only the creation of a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(source: Path, planted: Path, marker: Path, pickled_rng: bool) -> None:
    """Copy a real checkpoint folder `source` to `planted` (a step folder, as step 99) as someone
    with write access to a checkpoint_dir would: its model/.metadata replaced by a pickle that
    creates `marker`, the manifest's checksums fixed up to match, COMPLETE, unsigned; with
    `pickled_rng`, RNG states pickled as older versions wrote them."""
    shutil.copytree(source, planted)
    metadata = planted / "model" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((planted / "manifest.json").read_text())
    for shard in manifest["shards"]:
        if shard["file_path"] == "model/.metadata":
            shard["file_size_bytes"] = metadata.stat().st_size
            shard["checksum"] = "sha256:" + hashlib.sha256(metadata.read_bytes()).hexdigest()
    manifest.update(step=99, status="COMPLETE", checkpoint_id=str(uuid.uuid4()))
    manifest.pop("signature", None)
    if pickled_rng:
        payload = base64.b64encode(pickle.dumps(_Payload(marker))).decode()
        for record in manifest["rng_states"]:
            record.update(numpy_rng_state=payload, python_rng_state=payload)
    (planted / "manifest.json").write_text(json.dumps(manifest))


# ---- fine-tuning: chat data and a LoRA job on a base model folder ------------------------------------
def write_chat(path: Path, count: int = 24) -> Path:
    lines = []
    for i in range(count):
        if i % 2:
            lines.append({"prompt": f"def f{i}(x):", "completion": f"    return x + {i}"})
        else:
            lines.append({"messages": [{"role": "system", "content": "Write Python."},
                                       {"role": "user", "content": f"import {i}"},
                                       {"role": "assistant", "content": f"from os import path{i}"}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def lora_job(base: Path, chat: Path, out: Path, steps: int = 6, **sections) -> dict:
    job = {"job_name": "lora", "seed": 3, "log_interval_steps": 100,
           "finetune_config": {"base_model": str(base), "method": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1},
           "data_config": {"dataset_path": str(chat), "sequence_length": 128, "global_batch_size": 4, "micro_batch_size": 2,
                           "validation_split": 0.2},
           "optimization_config": {"total_steps": steps, "warmup_steps": 1, "learning_rate": 1e-2, "weight_decay": 0.0},
           "memory_config": {"zero_stage": 0}, "checkpoint_config": {"checkpoint_dir": str(out)}}
    job.update(sections)
    return job
