"""Server settings: built once by `pagedllm serve` (or a test) and handed to `create_app`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES
from pagedllm.jobs.settings import DEFAULT_MAX_PENDING_JOBS


@dataclass(frozen=True)
class ModelSpec:
    """A model served under `name`, loaded from the Hugging Face folder `path`."""

    name: str
    path: str


@dataclass(frozen=True)
class LoRAModule:
    """A LoRA adapter served from start-up as model `name` (--lora-modules name=path)."""

    name: str
    path: str


@dataclass(frozen=True)
class ChatOptions:
    """How chat requests are rendered and their tool calls read, for every model (vLLM's flags)."""

    chat_template: str | None = None  # Jinja text replacing each model's own template (--chat-template)
    tool_call_parser: str = "hermes"  # the format tool calls are written and read in (tool_parsers/)
    enable_auto_tool_choice: bool = True  # tool_choice "auto" parses calls (else it is refused, as vLLM)
    trust_request_chat_template: bool = False  # a request's `chat_template` is rendered (else a 400)

    def __post_init__(self) -> None:
        from pagedllm.entrypoints.tool_parsers import parser_class

        parser_class(self.tool_call_parser)  # an unknown parser fails at start-up


@dataclass
class ServerSettings:
    models: list[ModelSpec] = field(default_factory=list)  # loaded at start-up
    model_dir: str | None = None  # its sub-folders can be loaded on demand, by folder name
    api_key: str | None = None
    protect_metrics: bool = False  # /metrics needs the API key too (it names the models served)
    max_waiting_requests: int | None = None  # per model; beyond it requests get 503 with Retry-After
    request_timeout_s: float | None = None  # a generation not finished by then (queue time included) gets 504
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body gets 413 before it is read (limits.py)
    engine_args: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields, for every model
    # /health says "degraded" from these on (None: max_waiting_requests * 0.8, else max_num_seqs)
    degraded_waiting_requests: int | None = None
    degraded_kv_cache_usage: float = 0.95
    # training job service (pagedllm/jobs): None disables it (`pagedllm serve` always passes a data dir)
    data_dir: str | None = None  # job store, job logs and default checkpoint folders
    train_slots: int | None = None  # processes training jobs may use at once (None: GPUs, else CPU cores)
    allowed_paths: list[str] = field(default_factory=list)  # besides data_dir: folders training jobs may use
    max_pending_jobs: int = DEFAULT_MAX_PENDING_JOBS  # training jobs waiting to start, at most (then 429)
    cluster: str | None = None  # "ray" / "ray://HOST:PORT": jobs (and serving replicas) on a Ray cluster
    data_parallel_size: int = 1  # engine replicas per model behind this server (processes, or Ray actors)
    chat: ChatOptions = field(default_factory=ChatOptions)
    lora_modules: list[LoRAModule] = field(default_factory=list)  # over the first start-up model

    def __post_init__(self) -> None:
        names = [spec.name for spec in self.models]
        if len(names) != len(set(names)):
            raise ValueError(f"served model names must be unique, got {names}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.protect_metrics and not self.api_key:
            raise ValueError("protect_metrics needs an api_key (--protect-metrics needs --api-key)")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.train_slots is not None and self.train_slots < 1:
            raise ValueError(f"train_slots must be >= 1, got {self.train_slots}")
        if self.max_pending_jobs < 1:
            raise ValueError(f"max_pending_jobs must be >= 1, got {self.max_pending_jobs}")
        if self.lora_modules:
            lora_names = [m.name for m in self.lora_modules]
            if not self.engine_args.get("enable_lora"):
                raise ValueError("--lora-modules needs --enable-lora")
            if not self.models:
                raise ValueError("--lora-modules needs a model loaded at start-up (--model) to serve them over")
            if len(set(lora_names)) != len(lora_names) or set(lora_names) & set(names):
                raise ValueError(f"--lora-modules names must be unique and differ from the model's, got {lora_names}")
            if self.data_parallel_size > 1:
                raise ValueError("--lora-modules is not supported with --data-parallel-size > 1")
        if not 0 < self.degraded_kv_cache_usage <= 1:
            raise ValueError(f"degraded_kv_cache_usage must be in (0, 1], got {self.degraded_kv_cache_usage}")
