"""/health: healthy, degraded (still serving, but queueing or short of KV blocks) or unhealthy.

A load balancer should keep sending traffic to a degraded server (HTTP 200) and stop sending it
to an unhealthy one (HTTP 503): an engine loop that died cannot serve until its model is
reloaded. A server with no model loaded is healthy — it may be serving only training routes.
"""
from __future__ import annotations

import math

from pagedllm.entrypoints.openai.models import ServedModel
from pagedllm.entrypoints.openai.protocol import HealthResponse, ModelHealth, ReplicaHealth
from pagedllm.entrypoints.openai.settings import ServerSettings

_RANK = {"healthy": 0, "degraded": 1, "unhealthy": 2}


def waiting_threshold(settings: ServerSettings, max_num_seqs: int) -> int:
    if settings.degraded_waiting_requests is not None:
        return settings.degraded_waiting_requests
    if settings.max_waiting_requests is not None:
        return max(1, math.ceil(0.8 * settings.max_waiting_requests))
    return max_num_seqs  # a full second batch is queued


def model_health(served: ServedModel, settings: ServerSettings) -> ModelHealth:
    stats = served.engine.stats
    health = ModelHealth(
        status="healthy",
        num_running=stats["num_running"],
        num_waiting=stats["num_waiting"],
        kv_cache_usage=stats["kv_cache_usage"],
    )
    replicas = served.engine.replica_views() if hasattr(served.engine, "replica_views") else None
    if replicas is not None:
        health.replicas = [ReplicaHealth(**{k: r[k] for k in ("replica", "alive", "pid", "node_id", "restarts")})
                           for r in replicas]
    down = [r["replica"] for r in replicas or [] if not r["alive"]]
    if not served.engine.alive:
        health.status, health.reason = "unhealthy", f"engine loop stopped: {served.engine.error!r}"
    elif down:
        health.status, health.reason = "degraded", f"replica {', '.join(map(str, down))} down (restarting)"
    elif health.num_waiting >= waiting_threshold(settings, served.max_num_seqs):
        health.status, health.reason = "degraded", f"{health.num_waiting} requests waiting"
    elif health.kv_cache_usage >= settings.degraded_kv_cache_usage:
        health.status, health.reason = "degraded", f"KV cache {health.kv_cache_usage:.0%} used"
    return health


def server_health(models: list[ServedModel], settings: ServerSettings) -> HealthResponse:
    per_model = {served.name: model_health(served, settings) for served in models}
    worst = max((h.status for h in per_model.values()), key=_RANK.__getitem__, default="healthy")
    return HealthResponse(status=worst, models=per_model)
