"""One engine replica of a data-parallel model, on its side of the wire: a process (or a Ray actor)
that owns an `LLMEngine` behind the same `AsyncEngine` the server uses in-process.

A request group arrives as `generate(prompts, params, arrival_time, priority)` and becomes the
stream of events the server replays into its own RequestGroup: ("accepted", None), then
("outputs", [RequestOutput, ...]) whenever outputs changed, or ("error", exception) for a rejection
(bad input, full queue). Closing the stream early aborts the requests, as leaving
`AsyncEngine.submit` does in-process.

Two transports carry it: a pipe to a spawned process (`run_process`: commands in, events out, stats
every 0.2 s) and Ray's streaming generators (`RayReplica`, an async actor). Both run `ReplicaCore`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

logger = logging.getLogger("pagedllm.server")

STATS_EVERY_S = 0.2


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica loads and how it runs: the model folder, the engine arguments, its CPU threads."""

    name: str
    path: str
    engine_args: dict[str, Any] = field(default_factory=dict)
    max_waiting_requests: int | None = None
    num_threads: int | None = None  # torch threads (CPU); None: torch's default


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of an engine it does not hold (limits checked before submitting)."""

    max_model_len: int
    kv_cache_tokens: int  # tokens the whole KV pool holds
    max_num_seqs: int
    vocab_size: int
    block_size: int
    max_num_batched_tokens: int
    eos_token_ids: frozenset[int] = frozenset()  # where beam search's hypotheses end
    notices: tuple[str, ...] = ()  # options asked for that this engine does not run, and why (StepPlanner)
    kv_cache_bytes: int = 0  # the KV pool's size (all ranks), printed when the server loads the model

    @classmethod
    def of(cls, engine) -> EngineInfo:
        from pagedllm.worker.kv_cache import bytes_per_block

        manager, config = engine.block_manager, engine.config
        pool_bytes = manager.num_blocks * bytes_per_block(engine.model_config, manager.block_size,
                                                          config.kv_torch_dtype(engine.model_config))
        return cls(engine.max_model_len, manager.num_blocks * manager.block_size, config.max_num_seqs,
                   engine.model_config.vocab_size, manager.block_size,
                   config.resolve_max_num_batched_tokens(engine.max_model_len), frozenset(engine.eos_token_ids),
                   engine.planner.notices, pool_bytes)

    def pool_line(self) -> str:
        """The KV pool in a few words, for the server's banner."""
        return (f"KV cache {self.kv_cache_tokens:,} tokens ({self.kv_cache_bytes / 2**20:,.0f} MiB), "
                f"max_model_len {self.max_model_len:,}, max_num_seqs {self.max_num_seqs}")


class ReplicaCore:
    """The engine of one replica on its own thread (`AsyncEngine`), driven from this process's loop."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from pagedllm.engine.llm_engine import LLMEngine
        from pagedllm.entrypoints.openai.async_engine import AsyncEngine

        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        engine = LLMEngine.from_engine_args(spec.path, **spec.engine_args)
        self.info = EngineInfo.of(engine)
        self.engine = AsyncEngine(engine, spec.name, spec.max_waiting_requests)

    def start(self) -> None:
        self.engine.start()

    async def generate(self, prompts: list, params, arrival_time: float, priority: int) -> AsyncIterator[tuple]:
        try:
            async with self.engine.submit(prompts, params, arrival_time, priority) as group:
                yield ("accepted", None)
                async for changed in group.updates():
                    yield ("outputs", changed)
        except Exception as exc:  # rejected, or the engine died: the server fails the group with it
            yield ("error", exc)

    async def request_states(self) -> list[dict]:
        return await self.engine.request_states()

    def stats(self) -> dict:
        return dict(self.engine.stats, alive=self.engine.alive, error=repr(self.engine.error) if self.engine.error else None)


# ---- a process, over a pipe ---------------------------------------------------------------------

def run_process(conn, spec: ReplicaSpec, parent_pid: int) -> None:
    """The replica process: load, say ("ready", info, pid), then serve commands until the pipe closes."""
    from pagedllm.worker.tensor_parallel import _exit_with_parent

    _exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING)
    try:
        core = ReplicaCore(spec)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    asyncio.run(_serve(conn, core))


async def _serve(conn, core: ReplicaCore) -> None:
    loop = asyncio.get_running_loop()
    core.start()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    threading.Thread(target=read, name="replica-inbox", daemon=True).start()
    conn.send(("ready", core.info, os.getpid()))
    tasks: dict[int, asyncio.Task] = {}
    reporter = asyncio.create_task(_report_stats(conn, core))
    while True:
        message = await inbox.get()
        if message[0] == "generate":
            key = message[1]
            tasks[key] = asyncio.create_task(_pump(conn, core, key, message[2:], tasks))
        elif message[0] == "abort":
            task = tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif message[0] == "states":
            asyncio.create_task(_answer_states(conn, core, message[1]))
        elif message[0] == "stop":
            break
    reporter.cancel()
    for task in tasks.values():
        task.cancel()
    await core.engine.shutdown()


async def _pump(conn, core: ReplicaCore, key: int, args: tuple, tasks: dict) -> None:
    try:
        async for event in core.generate(*args):
            conn.send(("event", key, event))
        conn.send(("done", key))
    except asyncio.CancelledError:
        pass  # aborted by the server: leaving generate() aborted the requests
    except (OSError, EOFError):
        pass  # the server is gone
    finally:
        tasks.pop(key, None)


async def _answer_states(conn, core: ReplicaCore, key: int) -> None:
    try:
        conn.send(("states", key, await core.request_states()))
    except (OSError, EOFError):
        pass


async def _report_stats(conn, core: ReplicaCore) -> None:
    while True:
        try:
            conn.send(("stats", core.stats()))
        except (OSError, EOFError):
            return
        await asyncio.sleep(STATS_EVERY_S)


# ---- a Ray actor ----------------------------------------------------------------------------------

class RayReplica:
    """An async Ray actor around ReplicaCore: `generate` is a streaming generator, one per request group."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.core: ReplicaCore | None = None

    async def start(self) -> tuple:
        import ray

        self.core = ReplicaCore(self.spec)
        self.core.start()
        return self.core.info, os.getpid(), ray.get_runtime_context().get_node_id()

    async def generate(self, prompts: list, params, arrival_time: float, priority: int):
        async for event in self.core.generate(prompts, params, arrival_time, priority):
            yield event

    async def stats(self) -> dict:
        return self.core.stats()

    async def request_states(self) -> list[dict]:
        return await self.core.request_states()
