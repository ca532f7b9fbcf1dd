"""The server's handles on engine replicas (replica.py is their other side): a spawned process over a
pipe, or a Ray actor on a cluster. Both expose the same small surface to the data-parallel engine:
`start()` (load; returns the engine's limits), `generate(...)` (an async stream of events),
`stats`, `alive`, `stop()`, and a death callback, called once, after which every stream of the
replica has ended with ReplicaDiedError.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from typing import Any, AsyncIterator

from pagedllm.entrypoints.openai.async_engine import EngineDeadError
from pagedllm.entrypoints.openai.replica import EngineInfo, ReplicaSpec, RayReplica, run_process

logger = logging.getLogger("pagedllm.server")

START_TIMEOUT_S = 600
_DONE = object()


class ReplicaDiedError(EngineDeadError):
    """The replica serving a request died while the request ran (it is being restarted)."""


class Replica:
    """What the data-parallel engine sees of one replica, whatever carries it."""

    def __init__(self, index: int, spec: ReplicaSpec, on_death: Callable[[Replica], None]) -> None:
        self.index, self.spec, self.on_death = index, spec, on_death
        self.info: EngineInfo | None = None
        self.stats: dict[str, Any] = {}
        self.alive = False
        self.pid: int | None = None
        self.node_id: str | None = None
        self.restarts = 0

    def died(self, why: str) -> None:
        """Mark dead once and tell the owner (on the event loop)."""
        if not self.alive:
            return
        self.alive = False
        logger.error("replica %d of model %r died: %s", self.index, self.spec.name, why)
        self.on_death(self)

    def death_error(self) -> ReplicaDiedError:
        return ReplicaDiedError(f"replica {self.index} of model {self.spec.name!r} died while the request ran "
                                f"({self.why}); it is being restarted and the other replicas keep serving: retry")

    why = "cause unknown"


class ProcessReplica(Replica):
    """A spawned process (replica.run_process) and a thread here that reads its pipe."""

    def __init__(self, index: int, spec: ReplicaSpec, on_death: Callable[[Replica], None]) -> None:
        super().__init__(index, spec, on_death)
        self.process = None
        self.conn = None
        self.streams: dict[int, asyncio.Queue] = {}
        self.queries: dict[int, asyncio.Future] = {}  # request_states() calls awaiting their answer
        self.keys = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> EngineInfo:
        self.loop = asyncio.get_running_loop()
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=run_process, args=(child, self.spec, os.getpid()), daemon=True,
                                       name=f"pagedllm-replica-{self.spec.name}-{self.index}")
        self.process.start()
        child.close()
        message = await asyncio.to_thread(self._first_message)
        if message[0] != "ready":
            self.process.join(5)
            raise RuntimeError(f"replica {self.index} of model {self.spec.name!r} failed to start: {message[1]}")
        _, self.info, self.pid = message
        self.alive, self.streams = True, {}
        threading.Thread(target=self._read, name=f"replica-{self.index}-reader", daemon=True).start()
        return self.info

    def _first_message(self) -> tuple:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.conn.poll(0.2):
            if not self.process.is_alive() or time.monotonic() > deadline:
                return ("failed", f"the process exited with code {self.process.exitcode}")
        try:
            return self.conn.recv()
        except EOFError:
            return ("failed", f"the process exited with code {self.process.exitcode}")

    def _read(self) -> None:
        conn, process = self.conn, self.process
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._post(self._dispatch, message)
        process.join(5)
        self._post(self._ended, f"its process exited with code {process.exitcode}")

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is exiting
            pass

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "stats":
            self.stats = message[1]
        elif kind == "states":
            answer = self.queries.pop(message[1], None)
            if answer is not None and not answer.done():
                answer.set_result(message[2])
        elif kind in ("event", "done"):
            queue = self.streams.get(message[1])
            if queue is not None:
                queue.put_nowait(message[2] if kind == "event" else _DONE)

    def _ended(self, why: str) -> None:
        self.why = why
        for answer in self.queries.values():
            if not answer.done():
                answer.set_result([])
        self.queries.clear()
        for queue in self.streams.values():
            queue.put_nowait(("error", self.death_error()))
        self.died(why)

    async def generate(self, prompts: list, params, arrival_time: float, priority: int) -> AsyncIterator[tuple]:
        if not self.alive:
            raise self.death_error()
        key = next(self.keys)
        queue = self.streams[key] = asyncio.Queue()
        finished = False
        try:
            self.conn.send(("generate", key, prompts, params, arrival_time, priority))
            while True:
                event = await queue.get()
                if event is _DONE:
                    finished = True
                    return
                yield event
                if event[0] == "error":
                    finished = True
                    return
        finally:
            self.streams.pop(key, None)
            if not finished and self.alive:
                try:
                    self.conn.send(("abort", key))
                except OSError:
                    pass

    async def request_states(self) -> list[dict]:
        """The replica's live requests (AsyncEngine.request_states, over the pipe); none if it is down."""
        if not self.alive:
            return []
        key = next(self.keys)
        answer = self.queries[key] = asyncio.get_running_loop().create_future()
        self.conn.send(("states", key))
        return await answer

    async def stop(self) -> None:
        self.alive = False
        if self.conn is not None:
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        if self.process is not None:
            await asyncio.to_thread(self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.to_thread(self.process.join)

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()


class RayActorReplica(Replica):
    """A RayReplica actor (one CPU, or one GPU, spread over the nodes); a stats call every 0.2 s is its pulse."""

    def __init__(self, index: int, spec: ReplicaSpec, on_death: Callable[[Replica], None], gpu: bool) -> None:
        super().__init__(index, spec, on_death)
        self.gpu = gpu
        self.actor = None
        self.watcher: asyncio.Task | None = None

    async def start(self) -> EngineInfo:
        import ray

        resources = {"num_gpus": 1, "num_cpus": 0} if self.gpu else {"num_cpus": 1}
        self.actor = ray.remote(RayReplica).options(max_concurrency=1000, scheduling_strategy="SPREAD",
                                                     name=f"pagedllm-replica-{self.spec.name}-{self.index}-{os.getpid()}-{self.restarts}",
                                                     **resources).remote(self.spec)
        try:
            self.info, self.pid, self.node_id = await self.actor.start.remote()
        except Exception as exc:
            ray.kill(self.actor)
            raise RuntimeError(f"replica {self.index} of model {self.spec.name!r} failed to start: {exc}") from exc
        self.alive = True
        self.watcher = asyncio.create_task(self._watch())
        return self.info

    async def _watch(self) -> None:
        from ray.exceptions import RayActorError

        while self.alive:
            try:
                self.stats = await self.actor.stats.remote()
            except RayActorError as exc:
                self.why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self.died(self.why)
                return
            await asyncio.sleep(0.2)

    async def generate(self, prompts: list, params, arrival_time: float, priority: int) -> AsyncIterator[tuple]:
        import ray
        from ray.exceptions import RayActorError

        if not self.alive:
            raise self.death_error()
        stream = self.actor.generate.options(num_returns="streaming").remote(prompts, params, arrival_time, priority)
        finished = False
        try:
            async for ref in stream:
                event = await ref
                yield event
            finished = True
        except RayActorError as exc:
            self.why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            finished = True
            yield ("error", self.death_error())
            self.died(self.why)
        finally:
            if not finished:
                ray.cancel(stream)

    async def request_states(self) -> list[dict]:
        from ray.exceptions import RayActorError

        if not self.alive:
            return []
        try:
            return await self.actor.request_states.remote()
        except RayActorError:
            return []

    async def stop(self) -> None:
        import ray

        self.alive = False
        if self.watcher is not None:
            self.watcher.cancel()
        if self.actor is not None:
            ray.kill(self.actor)
