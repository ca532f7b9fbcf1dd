"""Data-parallel serving: N engine replicas of one model behind one API server (`--data-parallel-size N`).

`DataParallelEngine` has AsyncEngine's surface (`submit`, `stats`, `alive`, `shutdown`), so the
OpenAI handlers do not know how many engines serve them. Each request group goes to one replica,
chosen by `PrefixRouter`: the replica with the fewest outstanding tokens (prompt + max_tokens of the
groups it was given and that have not finished), except that a replica whose prefix cache should hold
the prompt's first blocks — the router remembers the block-hash chains of the prompts it sent where —
is preferred while its load stays within a bound of the least loaded (SGLang's cache-aware router):
no more than one step's token budget more outstanding tokens, and no more than MAX_GROUP_SKEW more
outstanding request groups. The second bound is the one that matters for chats: they share the chat
template's system prefix and ask for few tokens, so by tokens alone 24 concurrent chats all went to
replica 0; by groups they spread over both.

A replica that dies fails its in-flight requests with ReplicaDiedError (503 `replica_died`, saying so)
and is started again (with back-off); the others keep serving meanwhile. The outputs a replica sends
are replayed into a RequestGroup here, so streaming, abort-on-exit, timeouts and metrics work as for
the in-process engine.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from pagedllm.entrypoints.openai.async_engine import EngineStoppedError, RequestGroup, RequestTimeout, StepObserver
from pagedllm.entrypoints.openai.replica import EngineInfo, ReplicaSpec
from pagedllm.entrypoints.openai.replicas import ProcessReplica, RayActorReplica, Replica

logger = logging.getLogger("pagedllm.server")

MAX_PREFIX_BLOCKS = 8  # the "first blocks" a prompt is matched by
MAX_GROUP_SKEW = 2  # outstanding request groups a prefix hit may put a replica ahead of the least busy
REMEMBERED_PREFIXES = 4096  # block-chain keys per replica (least recently routed forgotten first)
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
SUMMED = ("num_running", "num_waiting", "num_swapped", "num_preemptions", "num_swap_outs", "prefix_cache_queries",
          "prefix_cache_hits", "num_free_blocks", "num_total_blocks", "num_free_cpu_blocks", "num_total_cpu_blocks",
          "prompt_tokens_total", "generation_tokens_total")


def prefix_keys(token_ids: list[int], block_size: int, limit: int = MAX_PREFIX_BLOCKS) -> list[bytes]:
    """Chained hashes of the prompt's first full blocks (each over its parent's, as the prefix cache's)."""
    keys, parent = [], b""
    for start in range(0, min(len(token_ids) // block_size, limit) * block_size, block_size):
        block = ",".join(map(str, token_ids[start:start + block_size])).encode()
        parent = hashlib.blake2b(parent + b"|" + block, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixRouter:
    """Picks a replica per request group: cached prefix first, within a bound of the least load."""

    def __init__(self, size: int, block_size: int, slack_tokens: int, group_skew: int = MAX_GROUP_SKEW) -> None:
        self.block_size, self.slack, self.group_skew = block_size, slack_tokens, group_skew
        self.load = [0] * size  # outstanding tokens per replica
        self.groups = [0] * size  # outstanding request groups per replica
        self.prefixes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(size)]

    def choose(self, token_ids: list[int], available: list[int]) -> tuple[int, str, list[bytes]]:
        """(replica, "prefix" or "load", the prompt's block keys) among `available` replicas."""
        keys = prefix_keys(token_ids, self.block_size)
        least = min(available, key=lambda i: (self.load[i], i))
        matched = {i: self._matched(i, keys) for i in available}
        best = max(available, key=lambda i: (matched[i], -self.load[i], -i))
        fewest = min(self.groups[i] for i in available)
        if (matched[best] > 0 and self.load[best] - self.load[least] <= self.slack
                and self.groups[best] - fewest <= self.group_skew):
            return best, "prefix", keys
        return least, "load", keys

    def _matched(self, index: int, keys: list[bytes]) -> int:
        """How many of the leading blocks were routed to this replica (a chain: stop at the first miss)."""
        seen = self.prefixes[index]
        count = 0
        for key in keys:
            if key not in seen:
                break
            count += 1
        return count

    def assign(self, index: int, keys: list[bytes], tokens: int) -> None:
        self.load[index] += tokens
        self.groups[index] += 1
        seen = self.prefixes[index]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > REMEMBERED_PREFIXES:
            seen.popitem(last=False)

    def release(self, index: int, tokens: int) -> None:
        self.load[index] -= tokens
        self.groups[index] -= 1

    def forget(self, index: int) -> None:
        """A restarted replica has an empty cache."""
        self.prefixes[index].clear()


class DataParallelEngine:
    """AsyncEngine's surface over N replicas (processes, or Ray actors with a cluster)."""

    def __init__(self, spec: ReplicaSpec, size: int, on_step: StepObserver | None = None,
                 request_timeout_s: float | None = None, ray: bool = False, ray_gpu: bool = False) -> None:
        self.name, self.spec, self.size = spec.name, spec, size
        self._on_step = on_step
        self.request_timeout_s = request_timeout_s
        self.replicas: list[Replica] = [self._replica(i, ray, ray_gpu) for i in range(size)]
        self.info: EngineInfo | None = None
        self.router: PrefixRouter | None = None
        self.routed = [{"prefix": 0, "load": 0} for _ in range(size)]  # requests groups per replica and reason
        self._closing = False
        self._restarts: set[asyncio.Task] = set()

    def _replica(self, index: int, ray: bool, gpu: bool) -> Replica:
        if ray:
            return RayActorReplica(index, self.spec, self._on_death, gpu)
        return ProcessReplica(index, self.spec, self._on_death)

    async def start(self) -> EngineInfo:
        """Start every replica (concurrently); all must load for the model to be served."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)
            raise failed[0]
        self.info = results[0]
        self.router = PrefixRouter(self.size, self.info.block_size, self.info.max_num_batched_tokens)
        return self.info

    # ---- AsyncEngine's surface ----

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        """Why nothing serves, while every replica is down (each is being restarted)."""
        if self.alive or self._closing:
            return None
        return self.replicas[0].death_error()

    @property
    def stats(self) -> dict[str, Any]:
        """The replicas' stats summed (KV usage from the summed block counts)."""
        parts = [r.stats for r in self.replicas if r.stats]
        out: dict[str, Any] = {key: sum(p.get(key, 0) for p in parts) for key in SUMMED}
        total = out["num_total_blocks"]
        out["kv_cache_usage"] = (total - out["num_free_blocks"]) / total if total else 0.0
        return out

    def replica_views(self) -> list[dict[str, Any]]:
        return [{"replica": r.index, "stats": r.stats, "routed": dict(self.routed[r.index]), "restarts": r.restarts,
                 "alive": r.alive, "pid": r.pid, "node_id": r.node_id} for r in self.replicas]

    @asynccontextmanager
    async def submit(self, prompts: list[tuple[str, Any]], params, arrival_time: float | None = None,
                     priority: int = 0) -> AsyncIterator[RequestGroup]:
        """AsyncEngine.submit over the chosen replica: all or none, aborted on leaving the block."""
        if self._closing:
            raise EngineStoppedError(f"model {self.name!r} is being unloaded")
        available = [r.index for r in self.replicas if r.alive]
        if not available:
            raise self.replicas[0].death_error()
        index, reason, keys = self.router.choose(prompt_ids(prompts[0][1]), available)
        cost = sum(len(prompt_ids(p)) + (params.max_tokens or 0) * max(params.n, params.best_of or 1) for _, p in prompts)
        self.router.assign(index, keys, cost)
        self.routed[index][reason] += 1
        loop = asyncio.get_running_loop()
        group = RequestGroup([request_id for request_id, _ in prompts], loop)
        if self.request_timeout_s is not None:
            group.timeout_s, group.deadline = self.request_timeout_s, time.monotonic() + self.request_timeout_s
        group.replica = index
        pump = asyncio.create_task(self._pump(self.replicas[index], group, prompts, params, arrival_time or time.time(), priority))
        try:
            await group.accepted
            yield group
        finally:
            if not pump.done():
                pump.cancel()  # closes the replica's stream: it aborts what has not finished
            self.router.release(index, cost)

    async def _pump(self, replica: Replica, group: RequestGroup, prompts, params, arrival: float, priority: int) -> None:
        try:
            async for kind, payload in replica.generate(prompts, params, arrival, priority):
                if kind == "accepted":
                    group._accept()
                elif kind == "outputs":
                    self._observe(payload)
                    for output in payload:
                        group._update(output)
                else:
                    group._fail(payload)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica was already dead
            group._fail(exc)

    def _observe(self, outputs: list) -> None:
        if self._on_step is not None:
            try:
                self._on_step(outputs)
            except Exception:  # metrics must never take serving down
                logger.exception("step observer failed")

    async def request_states(self) -> list[dict[str, Any]]:
        """Every replica's live requests (GET /v1/requests), in one list."""
        parts = await asyncio.gather(*(r.request_states() for r in self.replicas), return_exceptions=True)
        return [row for part in parts if isinstance(part, list) for row in part]

    def abort(self, request_ids: list[str]) -> None:
        """Unused by the handlers (leaving submit aborts); kept for AsyncEngine's surface."""

    async def shutdown(self) -> None:
        self._closing = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)

    # ---- replicas that die ----

    def _on_death(self, replica: Replica) -> None:
        if self._closing:
            return
        task = asyncio.get_running_loop().create_task(self._restart(replica))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, replica: Replica) -> None:
        """Start the replica again in place, backing off while it keeps failing; its cache starts empty."""
        self.router.forget(replica.index)
        attempt = 0
        while not self._closing:
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            await replica.stop()
            replica.restarts += 1
            try:
                await replica.start()
                logger.info("replica %d of model %r restarted (restart %d)", replica.index, self.name, replica.restarts)
                return
            except Exception as exc:
                logger.error("replica %d of model %r did not restart: %s", replica.index, self.name, exc)
                attempt += 1


def prompt_ids(prompt: Any) -> list[int]:
    """The token ids of an engine prompt (the server always sends ids; a bare string has none to route by)."""
    if isinstance(prompt, dict):
        return list(prompt.get("prompt_token_ids") or [])
    if isinstance(prompt, list):
        return prompt
    return []


__all__ = ["DataParallelEngine", "PrefixRouter", "RequestTimeout", "prefix_keys"]
