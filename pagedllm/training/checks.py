"""What `pagedllm train` (and `pagedllm finetune`, and the job service before it stores a job)
checks before any process starts: the cross-field rules, the base model, the dataset, the tokenizer."""
from __future__ import annotations

from pagedllm.training.config import ConfigError, TrainingJob, resolve
from pagedllm.training.pretrained import apply_base_model


def check_job(job: TrainingJob, world_size: int) -> TrainingJob:
    """Everything `pagedllm train` checks before starting a process, for a job already in memory
    (what a service calls): the cross-field rules for `world_size`, and that the dataset and the
    tokenizer exist. Returns the job unchanged -- a fine-tune's with model_config read from its base
    model, so the job.json written from it agrees with the base; raises ConfigError naming the field."""
    from pagedllm.training.corpus import source_files
    from pagedllm.training.tokenizer import tokenizer_files

    if job.finetune is not None:
        job = apply_base_model(job)
    resolve(job, world_size)
    if job.finetune is not None:
        from pagedllm.training.chat_data import ChatDataError, read_conversations

        try:
            read_conversations(job.data.dataset_path)
        except ChatDataError as exc:
            raise ConfigError("data_config.dataset_path", str(exc)) from exc
        return job
    try:
        source_files(job.data.dataset_path, job.data.file_glob)
    except FileNotFoundError as exc:
        raise ConfigError("data_config.dataset_path", str(exc)) from exc
    try:
        tokenizer_files(job.data.tokenizer_path)
    except FileNotFoundError as exc:
        raise ConfigError("data_config.tokenizer_path", str(exc)) from exc
    return job
