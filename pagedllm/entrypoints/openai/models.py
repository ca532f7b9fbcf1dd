"""The model registry: which models are loaded, loading or loadable, and by which name.

Each loaded model has its own `LLMEngine` (so its own KV budget, from the shared engine args)
on its own engine thread. Models named at start-up are loaded before the server accepts
connections; sub-folders and .gguf files of `--model-dir` are loaded on demand, by name. Loading runs on
a worker thread, so the models already loaded keep serving meanwhile.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, TypeVar

from pagedllm.engine.llm_engine import LLMEngine, load_tokenizer
from pagedllm.lora.request import LoRARequest
from pagedllm.entrypoints.openai.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.data_parallel import DataParallelEngine
from pagedllm.entrypoints.openai.limits import max_token_chars, prompt_char_limit
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.entrypoints.openai.replica import EngineInfo, ReplicaSpec
from pagedllm.entrypoints.openai.settings import ChatOptions, ServerSettings
from pagedllm.entrypoints.model_names import loadable_models
from pagedllm.entrypoints.tool_parsers import ToolParser, parser_class
from pagedllm.http_errors import (
    BadRequestError,
    ConflictError,
    ModelNotFoundError,
    ServiceUnavailableError,
)

logger = logging.getLogger("pagedllm.server")
T = TypeVar("T")


@dataclass
class ServedModel:
    name: str
    path: str
    engine: AsyncEngine | DataParallelEngine
    # The server's own tokenizer copy (chat templates, echo, /tokenize): the engine's tokenizer
    # belongs to the engine thread, and a fast tokenizer is not safe to share across threads.
    tokenizer: Any | None
    created: int
    info: EngineInfo  # the engine's limits, read once at load (the engine may live in another process)
    # Where prompts are rendered and tokenized: one thread per model, so the tokenizer is used by
    # one thread at a time and a long prompt never holds the event loop (limits.py).
    tokenizer_thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "pagedllm-tokenizer"))
    max_token_chars: int = 1  # the longest vocabulary entry (limits.prompt_char_limit)
    chat: ChatOptions = field(default_factory=ChatOptions)  # templates and tool calls (the server's flags)
    # A LoRA adapter served over this model: requests naming it run with it (`ModelRegistry.get`)
    lora_request: LoRARequest | None = None
    parent: str | None = None  # the base model's name, for an adapter

    @property
    def tool_parser(self) -> type[ToolParser]:
        return parser_class(self.chat.tool_call_parser)

    async def on_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on this model's tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, partial(fn, *args, **kwargs))

    @property
    def max_prompt_chars(self) -> int:
        """A prompt with more characters cannot fit max_model_len tokens: refused untokenized."""
        return prompt_char_limit(self.max_model_len, self.max_token_chars)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the whole KV pool holds (of one replica, with data parallelism)."""
        return self.info.kv_cache_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.info.max_num_seqs

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.info.eos_token_ids

    def card(self) -> ModelCard:
        if self.lora_request is not None:
            return ModelCard(id=self.name, created=self.created, max_model_len=self.max_model_len,
                             root=self.lora_request.lora_path, parent=self.parent)
        return ModelCard(id=self.name, created=self.created, max_model_len=self.max_model_len, root=self.path)


@dataclass(frozen=True)
class CatalogEntry:
    """A model a client can name, and where it stands: ready, loading, failed or available (loadable)."""

    name: str
    status: str
    max_model_len: int | None = None
    error: str | None = None
    parent: str | None = None  # a LoRA adapter's base model


class ModelRegistry:
    def __init__(self, settings: ServerSettings, metrics: ServerMetrics):
        self.settings = settings
        self.metrics = metrics
        self._startup_paths = {spec.name: spec.path for spec in settings.models}
        self._ready: dict[str, ServedModel] = {}
        self._loading: dict[str, asyncio.Task[ServedModel]] = {}
        self._failed: dict[str, str] = {}
        self._adapters: dict[str, ServedModel] = {}  # LoRA adapter name -> its view of the base model
        self._lora_ids = itertools.count(1)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the start-up models; what each was asked to run and does not (EngineInfo.notices)
        is printed whatever the log level, as the server's banner is."""
        for spec in self.settings.models:
            served = await self._load(spec.name, spec.path)
            print(f"pagedllm serve: model {spec.name!r}: {served.info.pool_line()}", file=sys.stderr, flush=True)
            for notice in served.info.notices:
                print(f"pagedllm serve: model {spec.name!r}: {notice}", file=sys.stderr, flush=True)
        for module in self.settings.lora_modules:  # --lora-modules: over the first start-up model
            await self.load_lora_adapter(module.name, module.path, self.settings.models[0].name)

    async def stop(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()
        await asyncio.gather(*(m.engine.shutdown() for m in self._ready.values()), return_exceptions=True)
        for served in self._ready.values():
            served.tokenizer_thread.shutdown(wait=False)
        self._ready.clear()

    # ---- lookup ------------------------------------------------------------------------------
    def ready(self) -> list[ServedModel]:
        return list(self._ready.values())

    def adapters(self) -> list[ServedModel]:
        """The LoRA adapters served, each as its base model with its LoRARequest (ServedModel.card has `parent`)."""
        return list(self._adapters.values())

    def snapshots(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, engine stats) of every loaded model, for the metrics collector (replicas summed)."""
        return [(served.name, served.engine.stats) for served in self._ready.values()]

    def replica_snapshots(self) -> list[dict[str, Any]]:
        """Every replica of the data-parallel models: its stats, requests routed to it (by reason),
        restarts and whether it is up, for the metrics collector."""
        return [{"model": served.name, **replica} for served in self._ready.values()
                if isinstance(served.engine, DataParallelEngine) for replica in served.engine.replica_views()]

    def get(self, name: str | None) -> ServedModel:
        """The loaded model a request names; with no name, the only loaded model."""
        if name is None:
            if len(self._ready) == 1:
                return next(iter(self._ready.values()))
            raise BadRequestError(f"model is required: {len(self._ready)} models are loaded", param="model")
        served = self._ready.get(name) or self._adapters.get(name)
        if served is not None:
            return served
        if name in self._loading:
            raise ServiceUnavailableError(f"model {name!r} is still loading; retry shortly", code="model_loading",
                                          headers={"Retry-After": "1"})
        if self.path_for(name) is not None:
            raise ModelNotFoundError(f"model {name!r} is not loaded; load it with POST /v1/models/{name}/load")
        raise ModelNotFoundError(f"the model {name!r} does not exist")

    def card(self, name: str) -> ModelCard:
        if name in self._ready:
            return self._ready[name].card()
        if name in self._adapters:
            return self._adapters[name].card()
        if name in self._loading:
            return ModelCard(id=name, created=int(time.time()), status="loading")
        if name in self._failed:
            return ModelCard(id=name, created=int(time.time()), status="failed", error=self._failed[name])
        return self.get(name).card()  # raises the right 404

    def catalog(self) -> list[CatalogEntry]:
        """Every model loaded, loading, failed or loadable (start-up models and --model-dir folders),
        by name, then the LoRA adapters served (with their parent); what the web console lists
        with load/unload buttons."""
        names = set(self._startup_paths) | set(self._ready) | set(self._loading) | set(self._failed)
        if self.settings.model_dir and Path(self.settings.model_dir).is_dir():
            names |= set(loadable_models(self.settings.model_dir))
        adapters = [CatalogEntry(a.name, "ready", a.max_model_len, parent=a.parent) for a in self._adapters.values()]
        return [self._entry(name) for name in sorted(names)] + sorted(adapters, key=lambda e: e.name)

    def _entry(self, name: str) -> CatalogEntry:
        if name in self._ready:
            return CatalogEntry(name, "ready", self._ready[name].max_model_len)
        if name in self._loading:
            return CatalogEntry(name, "loading")
        if name in self._failed:
            return CatalogEntry(name, "failed", error=self._failed[name])
        return CatalogEntry(name, "available")

    def path_for(self, name: str) -> str | None:
        """Where `name` loads from: a start-up model, or a model folder or NAME.gguf file directly in model_dir."""
        if name in self._startup_paths:
            return self._startup_paths[name]
        if not self.settings.model_dir or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            return None
        if len(f"{name}.gguf".encode()) > 255:  # no file system holds such a name (stat would raise ENAMETOOLONG)
            return None
        if not Path(self.settings.model_dir).is_dir():
            return None
        path = loadable_models(self.settings.model_dir).get(name)  # model_names.py: one name per file
        return str(path) if path is not None else None

    # ---- load / unload -----------------------------------------------------------------------
    async def load(self, name: str, wait: bool = False) -> str:
        """Start loading `name` (no-op when loaded or loading); "ready" or "loading"."""
        if name in self._ready:
            return "ready"
        task = self._loading.get(name)
        if task is None:
            path = self.path_for(name)
            if path is None:
                where = f" in --model-dir {self.settings.model_dir!r}" if self.settings.model_dir else " (no --model-dir)"
                raise ModelNotFoundError(f"no model folder named {name!r}{where}")
            task = asyncio.create_task(self._load(name, path))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures live in _failed
            self._loading[name] = task
        if not wait:
            return "loading"
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # this request itself was cancelled
            raise ConflictError(f"model {name!r} was unloaded while it was loading") from None
        except ValueError as exc:  # ModelLoadError or a bad engine argument
            raise BadRequestError(f"model {name!r} failed to load: {exc}", param="model_id") from exc
        return "ready"

    async def _load(self, name: str, path: str) -> ServedModel:
        self._failed.pop(name, None)
        try:
            if self.settings.data_parallel_size > 1:
                async_engine, info = await self._start_replicas(name, path)
                tokenizer_path = self.settings.engine_args.get("tokenizer") or path
            else:
                engine = await asyncio.to_thread(LLMEngine.from_engine_args, path, **self.settings.engine_args)
                async_engine = AsyncEngine(engine, name, self.settings.max_waiting_requests, self.metrics.observer(name),
                                           request_timeout_s=self.settings.request_timeout_s)
                info, tokenizer_path = EngineInfo.of(engine), engine.config.tokenizer or path
            tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
            token_chars = await asyncio.to_thread(max_token_chars, tokenizer) if tokenizer is not None else 1
        except Exception as exc:
            logger.error("model %r failed to load from %s: %s", name, path, exc)
            self._failed[name] = str(exc)
            raise
        finally:
            self._loading.pop(name, None)
        if isinstance(async_engine, AsyncEngine):
            async_engine.start()
        served = ServedModel(name, path, async_engine, tokenizer, int(time.time()), info,
                             ThreadPoolExecutor(1, f"pagedllm-tokenizer-{name}"), token_chars, self.settings.chat)
        self._ready[name] = served
        logger.info("model %r ready (%s, max_model_len=%d)", name, path, served.max_model_len)
        return served

    async def _start_replicas(self, name: str, path: str) -> tuple[DataParallelEngine, EngineInfo]:
        """--data-parallel-size N: N replicas (processes, or Ray actors with --cluster), each with this
        machine's CPU threads split between the local ones."""
        settings, size = self.settings, self.settings.data_parallel_size
        on_ray = settings.cluster is not None
        threads = None
        if not on_ray and settings.engine_args.get("device", "cpu") == "cpu":
            threads = max(1, (os.cpu_count() or 1) // size)
        spec = ReplicaSpec(name, path, dict(settings.engine_args), settings.max_waiting_requests, threads)
        gpu = False
        if on_ray:
            import ray

            from pagedllm.jobs.ray_cluster import connect, ray_address

            connect(ray_address(settings.cluster))  # on this thread: ray.init touches signal handlers
            gpu = ray.cluster_resources().get("GPU", 0) > 0
        engine = DataParallelEngine(spec, size, self.metrics.observer(name), settings.request_timeout_s, on_ray, gpu)
        info = await engine.start()
        return engine, info

    # ---- LoRA adapters (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -------------------
    async def load_lora_adapter(self, name: str, path: str, base: str | None = None) -> ServedModel:
        """Serve the PEFT adapter at `path` as model `name` over `base` (the only loaded model when
        None). The engine loads and validates it first: a bad adapter is a 400 naming why, and
        nothing is registered."""
        if name in self._adapters or name in self._ready or name in self._loading:
            raise BadRequestError(f"the name {name!r} is already in use by a model or LoRA adapter", param="lora_name")
        served = self.get(base)
        if served.lora_request is not None:
            raise BadRequestError(f"{served.name!r} is a LoRA adapter, not a base model", param="model")
        if not isinstance(served.engine, AsyncEngine):
            raise BadRequestError("LoRA adapters are not supported with --data-parallel-size > 1", param="lora_name")
        request = LoRARequest(name, next(self._lora_ids), path, served.name)
        try:
            await served.engine.call(lambda engine: engine.add_lora(request))
        except ValueError as exc:  # LoRAError: the adapter's own fault; the engine is untouched
            raise BadRequestError(f"LoRA adapter {name!r} cannot be loaded: {exc}", param="lora_path") from exc
        adapter = replace(served, name=name, lora_request=request, parent=served.name, created=int(time.time()))
        self._adapters[name] = adapter
        logger.info("LoRA adapter %r ready over %r (%s)", name, served.name, path)
        return adapter

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name`: new requests naming it get 404; requests already running
        with it finish (they reload it from its folder if it was dropped from memory)."""
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise ModelNotFoundError(f"the LoRA adapter {name!r} is not loaded")
        lora_int_id = adapter.lora_request.lora_int_id
        try:
            await adapter.engine.call(lambda engine: engine.remove_lora(lora_int_id))
        except Exception as exc:  # an engine that stopped has nothing left to free
            logger.warning("LoRA adapter %r: its engine did not remove it: %s", name, exc)
        logger.info("LoRA adapter %r unloaded", name)

    async def unload(self, name: str) -> None:
        """Unload `name`; its in-flight requests end with finish_reason "abort"."""
        task = self._loading.get(name)
        if task is not None:
            task.cancel()  # the worker thread finishes its load and the result is dropped
            return
        if name in self._adapters:
            await self.unload_lora_adapter(name)
            return
        served = self._ready.pop(name, None)
        if served is None:
            self.get(name)  # raises the precise 404
            raise ModelNotFoundError(f"model {name!r} is not loaded")
        for adapter in [a for a in self._adapters.values() if a.parent == name]:
            del self._adapters[adapter.name]  # an adapter goes with its base model
        await served.engine.shutdown()
        served.tokenizer_thread.shutdown(wait=False)
        logger.info("model %r unloaded", name)
