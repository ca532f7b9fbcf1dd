"""The platform's TrainingJob as pydantic models: the one config that flows from the entry point down.

Field names and sections are the platform design's (`model_config`, `parallelism_config`, ...). Fields the design
does not name but a real run needs (head_dim, rope_theta, pipeline_schedule, validation_split, seed,
...) are added next to the design's fields and documented in docs/training.md. Unknown keys are
rejected so a typo never silently falls back to a default.

Two levels of checking: pydantic validates each field on its own; `resolve(job, world_size)` checks
the cross-field rules that need the world size (tp x pp x dp = world, batch divisibility, heads vs
tp, ...) and raises `ConfigError` naming the field. The CLI runs both before any process starts.
"""
from __future__ import annotations

import enum
import json
import tomllib
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_JOB_NAME_CHARS = 256

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "moe")


class ConfigError(ValueError):
    """A user error in the job config; `field` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class _Section(BaseModel):
    # allow_inf_nan=False: `learning_rate: Infinity` (JSON) or `inf` (TOML) is refused naming the field,
    # in every float field of every section, as the OpenAI routes refuse them in requests.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False, allow_inf_nan=False)


class JobStatus(str, enum.Enum):
    """The TrainingJob states plus CANCELLED, which the job service (issue 5) needs."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def active(self) -> bool:
        """Has (or may have) processes, so holds worker slots."""
        return self in (JobStatus.RUNNING, JobStatus.CHECKPOINTING)

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


class Optimizer(str, enum.Enum):
    ADAM = "ADAM"
    ADAMW = "ADAMW"
    LAMB = "LAMB"


class LRScheduler(str, enum.Enum):
    COSINE = "COSINE"
    LINEAR = "LINEAR"
    CONSTANT = "CONSTANT"


class Precision(str, enum.Enum):
    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    FP8 = "FP8"


class Fp8Recipe(str, enum.Enum):
    """torchao's float8 scaling recipes (training/fp8.py)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


class CheckpointGranularity(str, enum.Enum):
    FULL = "FULL"
    SELECTIVE = "SELECTIVE"


class PipelineSchedule(str, enum.Enum):
    ONE_F_ONE_B = "1F1B"
    GPIPE = "GPIPE"
    INTERLEAVED_1F1B = "INTERLEAVED_1F1B"


class ModelShapeConfig(_Section):
    """The transformer's shape. Defaults are the embedded default model's (configs/pagedllm-py-tiny.toml)."""

    architecture: str = "llama"
    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(256, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(768, ge=1)
    vocab_size: int = Field(8192, ge=2)
    max_position_embeddings: int = Field(2048, ge=1)
    num_experts: int | None = Field(None, ge=1)
    num_experts_per_token: int | None = Field(None, ge=1)
    # Not in the seed; needed to match the Hugging Face configs exactly.
    head_dim: int | None = Field(None, ge=1, description="qwen3 sets it explicitly; else hidden/heads")
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    tie_word_embeddings: bool = False
    sliding_window: int | None = Field(None, ge=1, description="mistral only; None = full causal")
    router_aux_loss_coef: float = Field(0.01, ge=0, description="moe load-balancing loss weight")
    initializer_range: float = Field(0.02, gt=0)
    # Hugging Face's attention_dropout: on the attention probabilities, while training only. It is
    # what makes the RNG state a checkpoint restores matter after a resume (issue 45).
    attention_dropout: float = Field(0.0, ge=0, lt=1)

    @field_validator("architecture")
    @classmethod
    def _known_architecture(cls, value: str) -> str:
        if value not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {value!r}; supported: {', '.join(ARCHITECTURES)}")
        return value

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class ParallelismConfig(_Section):
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int | None = Field(None, ge=1, description="derived from the world size when None")
    expert_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = False
    context_parallel_size: int = Field(1, ge=1)
    # Not in the seed.
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    stages_per_rank: int | None = Field(None, ge=1, description="virtual stages; 2 for INTERLEAVED_1F1B")

    @property
    def resolved_stages_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.pipeline_schedule is PipelineSchedule.INTERLEAVED_1F1B else 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def world_size(self) -> int:
        """Processes this config needs, taking data_parallel_size as 1 when it is not given."""
        return self.model_parallel_size * (self.data_parallel_size or 1)


class OptimizationConfig(_Section):
    optimizer: Optimizer = Optimizer.ADAMW
    learning_rate: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    epsilon: float = Field(1e-8, gt=0)
    gradient_clipping: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    warmup_steps: int = Field(100, ge=0)
    total_steps: int = Field(1000, ge=1)
    lr_scheduler: LRScheduler = LRScheduler.COSINE
    # Not in the seed.
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="floor of COSINE/LINEAR decay, x learning_rate")


class MemoryConfig(_Section):
    precision: Precision = Precision.FP32
    zero_stage: Literal[0, 1, 2, 3] = 3
    gradient_checkpointing: bool = False
    cpu_offload: bool = False
    nvme_offload: bool = False
    activation_checkpointing_granularity: CheckpointGranularity = CheckpointGranularity.FULL
    # Not in the seed.
    fp8_recipe: Fp8Recipe = Field(Fp8Recipe.TENSORWISE, description="precision FP8: torchao's scaling recipe")
    nvme_offload_dir: str | None = Field(None, description="nvme_offload's state files; default <checkpoint_dir>/nvme-offload")


class DataConfig(_Section):
    dataset_path: str = Field(description="text file, folder of text files, JSONL with 'text', or '@stdlib'")
    tokenizer_path: str | None = Field(None, description="a tokenizer.json (or the folder holding it); a fine-tune takes its base model's")
    sequence_length: int = Field(512, ge=2)
    global_batch_size: int = Field(32, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    # Not in the seed.
    file_glob: str = Field("**/*", description="files taken from a dataset folder")
    validation_split: float = Field(0.0, ge=0, lt=1, description="fraction of documents held out")
    eval_interval_steps: int = Field(0, ge=0, description="0 = evaluate only at the end")
    eval_sequences: int = Field(256, ge=1, description="validation sequences per evaluation")
    cache_dir: str | None = Field(None, description="token cache; default ~/.cache/pagedllm/datasets")


class FinetuneMethod(str, enum.Enum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"


DEFAULT_BASE_MODEL = "@default"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FinetuneConfig(_Section):
    """Start from a pretrained model and train it on chat / instruction data (docs/training.md, "Fine-tuning").

    The base model gives the shape (model_config), the weights, the tokenizer and the chat template;
    the dataset is JSONL with `messages` or `prompt`/`completion` (training/chat_data.py)."""

    base_model: str = Field(DEFAULT_BASE_MODEL, description="a Hugging Face folder, a .gguf file or '@default' (SmolLM2-135M-Instruct)")
    method: FinetuneMethod = FinetuneMethod.LORA
    lora_rank: int = Field(8, ge=1, le=1024)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown target module(s) {unknown}; supported: {', '.join(LORA_TARGETS)}")
        return value

    @property
    def adapter(self) -> bool:
        """LoRA or QLoRA: only the adapter trains, and checkpoints hold only it."""
        return self.method is not FinetuneMethod.FULL


class CheckpointConfig(_Section):
    checkpoint_dir: str = "checkpoints"
    checkpoint_interval_steps: int | None = Field(None, ge=0, description="None or 0 = no step-based saves")
    checkpoint_interval_minutes: float | None = Field(None, ge=0, description="None or 0 = no time-based saves")
    max_checkpoints_to_keep: int = Field(3, ge=1)
    async_save: bool = False
    # Not in the seed.
    checkpoint_on_stop: bool = Field(True, description="save when stopped by a signal or the stop file")


def _now() -> datetime:
    return datetime.now(timezone.utc)


class TrainingJob(BaseModel):
    """A training job: model, parallelism, optimization, memory, data and checkpoint configs. `status`/timestamps are for the job service; the trainer ignores them."""

    model_config = ConfigDict(
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )

    job_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    job_name: str = Field("pagedllm-job", min_length=1, max_length=MAX_JOB_NAME_CHARS)
    status: JobStatus = JobStatus.PENDING
    created_at: datetime = Field(default_factory=_now)
    updated_at: datetime = Field(default_factory=_now)

    model: ModelShapeConfig = Field(default_factory=ModelShapeConfig, alias="model_config")
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig, alias="parallelism_config")
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig, alias="optimization_config")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, alias="memory_config")
    data: DataConfig = Field(alias="data_config")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, alias="checkpoint_config")
    # Not in the seed: start from a pretrained model (None = from scratch, model_config is the shape).
    finetune: FinetuneConfig | None = Field(None, alias="finetune_config")
    # Not in the seed.
    seed: int = 0
    log_interval_steps: int = Field(10, ge=1)

    @field_validator("job_name")
    @classmethod
    def _printable_name(cls, name: str) -> str:
        """Names go to logs, the job store and the console: valid Unicode, no control characters."""
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode (it contains a lone surrogate)") from None
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise ValueError("must not contain control characters")
        return name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.checkpoint_dir)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "<root>"


def parse_job(data: dict[str, Any]) -> TrainingJob:
    """Validate a dict as a TrainingJob, turning pydantic's error into a ConfigError naming the field."""
    try:
        job = TrainingJob.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(_field_path(first["loc"]), first["msg"]) from exc
    _check_tokenizer_given(job)
    return job


def _check_tokenizer_given(job: TrainingJob) -> None:
    """A model trained from scratch needs a tokenizer; a fine-tune takes its base model's."""
    if job.finetune is None and job.data.tokenizer_path is None:
        raise ConfigError("data_config.tokenizer_path", "Field required (unless finetune_config names a base model)")


def load_job(path: str | Path) -> TrainingJob:
    """Read a TOML or JSON job file (by suffix)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--config", f"no such file: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError("--config", f"expected a .toml or .json file, got {path.name}")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("--config", f"{path.name} is not valid {path.suffix[1:].upper()}: {exc}") from None
    return parse_job(data)


def apply_overrides(job: TrainingJob, overrides: list[str]) -> TrainingJob:
    """`section.field=value` overrides from the command line; values are JSON, else plain strings."""
    if not overrides:
        return job
    data = job.model_dump(mode="json", exclude_unset=True)  # keeps "was it given?" (e.g. job_id) intact
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(key, f"{part} is not a config section")
        node[leaf] = value
    return parse_job(data)


def resolve(job: TrainingJob, world_size: int) -> TrainingJob:
    """Check the cross-field rules for `world_size` processes; return the job with data_parallel_size set."""
    if job.finetune is not None:  # model_config is the base's: pretrained.apply_base_model, called before
        _check_finetune(job)
    else:
        _check_tokenizer_given(job)
    par = job.parallelism
    dp = _resolve_data_parallel(par, world_size)
    _check_unsupported(job, dp)
    _check_model_shape(job.model, par)
    _check_batch(job, dp)
    return job.model_copy(update={"parallelism": par.model_copy(update={"data_parallel_size": dp})})


def _check_finetune(job: TrainingJob) -> None:
    """What a fine-tune does not combine with (docs/training.md, "What composes with fine-tuning").
    Full fine-tuning and LoRA run under tensor and pipeline parallelism (the pipeline passes the
    packed rows' segment ids to every stage; lora_parallel.py shards the pairs). QLoRA's quantized
    blocks are not sharded for tensor parallelism; sequence parallelism's sequence shards do not carry
    the segment ids into attention nor let the output layer pick the trained positions."""
    par = job.parallelism
    if job.data.tokenizer_path is not None:
        raise ConfigError("data_config.tokenizer_path", "a fine-tune uses its base model's tokenizer; leave tokenizer_path out")
    if par.tensor_parallel_size > 1 and job.finetune.method is FinetuneMethod.QLORA:
        raise ConfigError("parallelism_config.tensor_parallel_size",
                          "qlora with tensor parallelism is not supported: the base's quantized blocks are not sharded; "
                          "use lora, or data/pipeline parallelism")
    if par.tensor_parallel_size > 1 and par.sequence_parallel:
        raise ConfigError("parallelism_config.sequence_parallel",
                          "fine-tuning with sequence parallelism is not supported: the packed examples' segment ids and "
                          "the trained positions are not passed through sequence shards (use false)")
    if job.finetune.method is FinetuneMethod.QLORA and job.memory.precision is not Precision.FP32:
        raise ConfigError("memory_config.precision", "qlora dequantizes its base to float32; use FP32")


def _resolve_data_parallel(par: ParallelismConfig, world_size: int) -> int:
    mp = par.model_parallel_size
    if par.data_parallel_size is not None:
        if mp * par.data_parallel_size != world_size:
            raise ConfigError(
                "parallelism_config.data_parallel_size",
                f"tensor_parallel_size {par.tensor_parallel_size} x pipeline_parallel_size "
                f"{par.pipeline_parallel_size} x data_parallel_size {par.data_parallel_size} "
                f"= {mp * par.data_parallel_size} != world size {world_size}",
            )
        return par.data_parallel_size
    if world_size % mp:
        raise ConfigError(
            "parallelism_config.tensor_parallel_size",
            f"tensor_parallel_size {par.tensor_parallel_size} x pipeline_parallel_size "
            f"{par.pipeline_parallel_size} = {mp} does not divide world size {world_size}",
        )
    return world_size // mp


def _check_unsupported(job: TrainingJob, dp: int) -> None:
    par, mem, model = job.parallelism, job.memory, job.model
    _check_expert_parallel(job, dp)
    _check_context_parallel(job)
    if mem.nvme_offload and mem.zero_stage == 0:
        raise ConfigError("memory_config.nvme_offload", "nvme_offload needs zero_stage >= 1 (it builds on FSDP's CPUOffloadPolicy)")
    if mem.precision is Precision.FP8:
        from pagedllm.training.fp8 import fp8_device_problem

        if problem := fp8_device_problem():
            raise ConfigError("memory_config.precision", problem)
    if model.architecture == "moe" and par.tensor_parallel_size > 1 and mem.precision is Precision.FP8:
        # under TP the experts compute on their weights' local tensors (model.local_linear), which
        # would bypass torchao's Float8Linear forward and train them in BF16 without saying so
        raise ConfigError("memory_config.precision", "FP8 with a moe and tensor_parallel_size > 1 is not supported: "
                          "the tp-replicated experts compute on local weights, not through Float8Linear (use BF16, or tp 1)")


def _check_expert_parallel(job: TrainingJob, dp: int) -> None:
    """EP (training/expert_parallel.py) shards a moe's experts over ranks that are also data-parallel
    replicas (as torchtitan borrows them from data parallelism): ep divides data_parallel_size and
    num_experts, and the expert shards are FSDP-wrapped, so ZeRO >= 1. With tensor parallelism the
    EP group holds one tp index (each tp rank's copy of the MoE all-to-alls with its own EP group).
    With CP each rank dispatches its sequence chunks, and the experts are FSDP-sharded over the
    data and context ranks holding them. With PP each stage dispatches over its pipeline rank's EP
    group (the EP ranks of a stage run the same schedule)."""
    par, field = job.parallelism, "parallelism_config.expert_parallel_size"
    ep = par.expert_parallel_size
    if ep == 1:
        return
    if job.model.architecture != "moe":
        raise ConfigError(field, f"expert parallelism needs a moe model (architecture is {job.model.architecture!r})")
    if dp % ep:
        raise ConfigError(field, f"{ep} does not divide data_parallel_size {dp} (EP ranks are data-parallel ranks too)")
    if (job.model.num_experts or 0) % ep:
        raise ConfigError(field, f"{ep} does not divide model_config.num_experts {job.model.num_experts}")
    if job.memory.zero_stage == 0:
        raise ConfigError(field, "expert parallelism wraps the expert shards with FSDP: use zero_stage >= 1")


def _check_context_parallel(job: TrainingJob) -> None:
    """CP (training/context_parallel.py): a ring over the sequence cut into 2 x cp load-balanced chunks;
    with TP each tp rank rings its own heads, with a moe the balance loss's statistics are cp-summed."""
    par, field = job.parallelism, "parallelism_config.context_parallel_size"
    cp = par.context_parallel_size
    if cp == 1:
        return
    if job.data.sequence_length % (2 * cp):
        raise ConfigError("data_config.sequence_length",
                          f"{job.data.sequence_length} is not divisible by 2 x context_parallel_size = {2 * cp} (load-balanced chunks)")
    if job.finetune is not None:
        raise ConfigError(field, "fine-tuning packs examples with per-example masks; the ring does not carry them (use 1)")
    if job.model.attention_dropout > 0:
        raise ConfigError(field, "attention_dropout with context parallelism is not supported (the ring computes attention in blocks)")


def _check_model_shape(model: ModelShapeConfig, par: ParallelismConfig) -> None:
    tp = par.tensor_parallel_size
    if model.head_dim is None and model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            "model_config.hidden_size",
            f"{model.hidden_size} is not divisible by num_attention_heads {model.num_attention_heads} (or set head_dim)",
        )
    if model.resolved_head_dim % 2:
        raise ConfigError("model_config.head_dim", f"rotary embeddings need an even head_dim, got {model.resolved_head_dim}")
    if model.num_attention_heads % model.num_kv_heads:
        raise ConfigError(
            "model_config.num_kv_heads",
            f"num_attention_heads {model.num_attention_heads} is not divisible by num_kv_heads {model.num_kv_heads}",
        )
    for name in ("num_attention_heads", "num_kv_heads"):
        if getattr(model, name) % tp:
            raise ConfigError(f"model_config.{name}", f"{getattr(model, name)} is not divisible by tensor_parallel_size {tp}")
    if model.intermediate_size % tp:
        raise ConfigError("model_config.intermediate_size", f"{model.intermediate_size} is not divisible by tensor_parallel_size {tp}")
    if par.resolved_stages_per_rank > 1 and par.pipeline_schedule is not PipelineSchedule.INTERLEAVED_1F1B:
        raise ConfigError(
            "parallelism_config.stages_per_rank",
            f"{par.stages_per_rank} stages per rank needs pipeline_schedule INTERLEAVED_1F1B",
        )
    stages = par.pipeline_parallel_size * par.resolved_stages_per_rank
    if model.num_layers < stages:
        raise ConfigError(
            "model_config.num_layers",
            f"{model.num_layers} layers cannot be cut into {stages} pipeline stages "
            f"(pipeline_parallel_size {par.pipeline_parallel_size} x stages_per_rank {par.resolved_stages_per_rank})",
        )
    if model.architecture == "moe":
        if not model.num_experts or model.num_experts < 2:
            raise ConfigError("model_config.num_experts", "moe needs num_experts >= 2")
        k = model.num_experts_per_token or 0
        if not 1 <= k <= model.num_experts:
            raise ConfigError("model_config.num_experts_per_token", f"moe needs 1 <= num_experts_per_token <= {model.num_experts}")


def _check_batch(job: TrainingJob, dp: int) -> None:
    data, par = job.data, job.parallelism
    per_step = data.micro_batch_size * dp
    if data.global_batch_size % per_step:
        raise ConfigError(
            "data_config.global_batch_size",
            f"{data.global_batch_size} is not divisible by micro_batch_size {data.micro_batch_size} "
            f"x data_parallel_size {dp} = {per_step}",
        )
    if data.sequence_length > job.model.max_position_embeddings:
        raise ConfigError(
            "data_config.sequence_length",
            f"{data.sequence_length} exceeds model_config.max_position_embeddings {job.model.max_position_embeddings}",
        )
    if par.sequence_parallel and data.sequence_length % par.tensor_parallel_size:
        raise ConfigError(
            "data_config.sequence_length",
            f"{data.sequence_length} is not divisible by tensor_parallel_size {par.tensor_parallel_size} (sequence_parallel)",
        )
    microbatches = data.global_batch_size // per_step
    stages = par.pipeline_parallel_size
    if stages > 1 and microbatches < stages:
        raise ConfigError(
            "data_config.global_batch_size",
            f"the pipeline needs at least {stages} microbatches per step, got {microbatches} "
            f"(global_batch_size / (micro_batch_size x data_parallel_size))",
        )
    if par.pipeline_schedule is PipelineSchedule.INTERLEAVED_1F1B and stages > 1 and microbatches % stages:
        raise ConfigError(
            "data_config.global_batch_size",
            f"INTERLEAVED_1F1B needs a microbatch count ({microbatches}) divisible by pipeline_parallel_size {stages}",
        )
