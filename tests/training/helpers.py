"""Tiny jobs shared by the training tests and by dist_scenarios.py (which torchrun runs as a script)."""
from __future__ import annotations

import copy
import shutil
import sysconfig
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
