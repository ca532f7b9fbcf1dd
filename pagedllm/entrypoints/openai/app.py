"""The FastAPI application factory: the platform's one HTTP front door.

`create_app(settings)` assembles components, each = an APIRouter plus (optionally) a *service*
with `async start()` / `async stop()` run by the app's lifespan (started in order before the
first request, stopped in reverse at shutdown). Today: the model registry (OpenAI routes, model
management, tokenization), the ops routes (/health, /metrics), the training job service and the web
console (the page at `/`, which has no service of its own). To add a component — e.g. the
training job service — build its service from `settings`, append it to `services`, include its
router, and put its state on `app.state`. Errors, the API key and OpenAPI apply to it unchanged.
"""
from __future__ import annotations

import logging
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, Protocol

from fastapi import FastAPI

from pagedllm.console.routes import ASSET_PREFIXES, PAGE_PATHS, install_console
from pagedllm.entrypoints.openai.auth import OPEN_PATHS, APIKeyMiddleware
from pagedllm.entrypoints.openai.errors import install_error_handlers
from pagedllm.entrypoints.openai.limits import BodyLimitMiddleware
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.models import ModelRegistry
from pagedllm.entrypoints.openai.openapi import install_openapi
from pagedllm.entrypoints.openai.routes import inference_router, ops_router
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.jobs.routes import jobs_router
from pagedllm.jobs.service import JobService

logger = logging.getLogger("pagedllm.server")


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def create_app(settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics()
    registry = ModelRegistry(settings, metrics)
    metrics.collect_engine_stats(registry.snapshots)
    metrics.collect_replica_stats(registry.replica_snapshots)
    jobs = JobService.from_settings(settings.data_dir, settings.train_slots, settings.allowed_paths, settings.cluster,
                                    settings.max_pending_jobs)
    services: list[Service] = [registry, jobs]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for service in services:
                await service.start()
                stack.push_async_callback(service.stop)
            yield

    app = FastAPI(
        title="pagedllm",
        summary="OpenAI-compatible inference server over a paged-KV-cache engine",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.models = registry
    app.state.metrics = metrics
    app.state.jobs = jobs
    app.state.services = services
    install_error_handlers(app)
    open_paths = (OPEN_PATHS - {"/metrics"} if settings.protect_metrics else OPEN_PATHS) | PAGE_PATHS
    # The last middleware added runs first: the key is checked from the headers, then the body's size.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, open_paths=open_paths,
                           open_prefixes=ASSET_PREFIXES)
    install_openapi(app, protected=bool(settings.api_key), open_paths=open_paths)
    app.include_router(inference_router)
    app.include_router(ops_router)
    app.include_router(jobs_router)
    install_console(app)
    return app
