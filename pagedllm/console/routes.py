"""The web console's routes: the page at `/`, its assets under /console/static/, and two JSON views
the public API does not give — every model a client can load (`/console/api/models`) and the
engines' counters with latency sums (`/console/api/stats`), polled by the page to draw its charts.

The page and its assets are open (a browser cannot send a header when it opens a page); the JSON
views sit behind the API key like the rest of the API, and the page sends the key it asks for.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.responses import Response

if TYPE_CHECKING:  # the app (entrypoints/openai) mounts the console: no import back at run time
    from pagedllm.entrypoints.openai.models import ModelRegistry

STATIC = Path(__file__).parent / "static"
ASSETS = "/console/static"
PAGE_PATHS = frozenset({"/", "/favicon.ico"})
ASSET_PREFIXES = (ASSETS + "/",)

console_router = APIRouter(tags=["console"])


class ConsoleModel(BaseModel):
    id: str
    status: Literal["ready", "loading", "failed", "available"]
    max_model_len: Optional[int] = None
    error: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model (the adapter is served over it)


class ConsoleModelList(BaseModel):
    data: list[ConsoleModel]


class LatencyTotal(BaseModel):
    sum: float
    count: float


class ModelStats(BaseModel):
    """One engine's counters at `time`; rates come from the difference of two readings."""

    model: str
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    latency_seconds: dict[str, LatencyTotal]  # ttft, itl, e2e, queue: sum and count


class ConsoleStats(BaseModel):
    time: float  # Unix time of the reading
    models: list[ModelStats]


def _registry(request: Request) -> ModelRegistry:
    return request.app.state.models


@console_router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


@console_router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> FileResponse:
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


@console_router.get("/console/api/models", response_model=ConsoleModelList)
async def console_models(request: Request) -> ConsoleModelList:
    entries = _registry(request).catalog()
    return ConsoleModelList(data=[ConsoleModel(id=e.name, status=e.status, max_model_len=e.max_model_len, error=e.error,
                                               parent=e.parent) for e in entries])


@console_router.get("/console/api/stats", response_model=ConsoleStats)
async def console_stats(request: Request) -> ConsoleStats:
    metrics = request.app.state.metrics
    readings = []
    for name, stats in _registry(request).snapshots():
        total = stats["num_total_blocks"]
        readings.append(ModelStats(
            model=name,
            num_running=stats["num_running"], num_waiting=stats["num_waiting"], num_swapped=stats["num_swapped"],
            kv_blocks_used=total - stats["num_free_blocks"], kv_blocks_total=total,
            kv_cache_usage=stats["kv_cache_usage"],
            prefix_cache_queries=stats["prefix_cache_queries"], prefix_cache_hits=stats["prefix_cache_hits"],
            num_preemptions=stats["num_preemptions"],
            prompt_tokens_total=stats["prompt_tokens_total"], generation_tokens_total=stats["generation_tokens_total"],
            latency_seconds=metrics.latency_totals(name),
        ))
    return ConsoleStats(time=time.time(), models=readings)


class RevalidatedFiles(StaticFiles):
    """Static files the browser revalidates on every load (a 304 when unchanged), so a page served
    by an upgraded server never runs with modules cached from the old one."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def install_console(app: FastAPI) -> None:
    app.include_router(console_router)
    app.mount(ASSETS, RevalidatedFiles(directory=STATIC), name="console-static")
