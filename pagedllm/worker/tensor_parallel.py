"""Tensor-parallel execution: rank 0's model runner in the engine's process, the other ranks in
worker processes that replay every step rank 0 broadcasts.

The scheduler and the block manager exist only in rank 0. Each step, rank 0 broadcasts the
step's plain metadata (`SchedulerOutput`: only what changed since the last step, so its size
does not grow with the sequences' lengths), every rank applies it to its own copy of the
sequences' state and runs the same forward pass on its part of the model and of every KV block;
rank 0 gathers the logits and samples. Each worker decides its planner from the same config. Workers are spawned
(not forked: the parent may hold threads and an OpenMP pool), exit when their parent does (they
watch its pid), and when one dies the others' next collective fails at once, so the engine's
step raises instead of hanging.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.distributed.group import ParallelGroup
from pagedllm.step.planner import StepPlanner
from pagedllm.step.runner_output import ModelRunnerOutput
from pagedllm.step.scheduler_output import SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner, kv_pool_sizes

logger = logging.getLogger("pagedllm.tensor_parallel")

_STARTED, _READY = "started", "ready"
_START_TIMEOUT_S = 300


@dataclass
class _WorkerArgs:
    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    pool_sizes: tuple[int, int]
    rank: int
    port: int
    parent_pid: int
    num_threads: int


class TensorParallelRunner:
    """Quacks like a `ModelRunner` (rank 0's, which it wraps) to the engine."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, planner: StepPlanner):
        size = config.tensor_parallel_size
        local = model_config.shard(size)  # checks that the ranks divide the model
        pools = kv_pool_sizes(config, local, max_model_len, num_ranks=size)
        device = config.torch_device(0)
        threads = max(1, (os.cpu_count() or 1) // size) if device.type == "cpu" else torch.get_num_threads()
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        context = mp.get_context("spawn")
        self._workers = _Workers([], [])
        for rank in range(1, size):
            receive, send = context.Pipe(duplex=False)
            args = _WorkerArgs(config, model_config, max_model_len, pools, rank, store.port, os.getpid(), threads)
            process = context.Process(target=_worker_main, args=(args, send), name=f"pagedllm-tp-rank{rank}", daemon=True)
            process.start()
            send.close()
            self._workers.processes.append(process)
            self._workers.pipes.append(receive)
        weakref.finalize(self, self._workers.stop)
        self._workers.wait_for(_STARTED)  # a worker that cannot even start fails fast, not at a timeout
        self._threads_before = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(threads)  # the ranks share this host's cores (restored at shutdown)
        self.group = ParallelGroup.connect(0, size, store.port, device, store)
        self._workers.group = self.group
        self.runner = ModelRunner(config, model_config, max_model_len, self.group, pools, planner)
        self._workers.wait_for(_READY)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.group.broadcast_object(sched)
        return self.runner.execute(sched)

    def shutdown(self) -> None:
        self._workers.stop()
        torch.set_num_threads(self._threads_before)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.processes]

    def __getattr__(self, name: str):
        if name == "runner":  # not built yet
            raise AttributeError(name)
        return getattr(self.runner, name)


@dataclass
class _Workers:
    processes: list
    pipes: list
    group: ParallelGroup | None = None
    stopped: bool = False

    def wait_for(self, expected: str) -> None:
        """Every worker reported `expected` (started; loaded its part of the model), or the error
        of the first that failed."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        for process, pipe in zip(self.processes, self.pipes):
            while not pipe.poll(0.1):
                if not process.is_alive() or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"tensor-parallel worker {process.name} did not start (exit code {process.exitcode}); "
                                       "a script that starts an engine with tensor_parallel_size > 1 needs an "
                                       "`if __name__ == '__main__':` guard, as multiprocessing's spawn re-imports it")
            message = pipe.recv()
            if message != expected:
                self.stop()
                raise RuntimeError(f"tensor-parallel worker {process.name} failed to start:\n{message}")

    def stop(self) -> None:
        """Tell live workers to leave their loop; kill what does not leave."""
        if self.stopped:
            return
        self.stopped = True
        if self.group is not None and all(p.is_alive() for p in self.processes):
            try:
                self.group.broadcast_object(None)
            except RuntimeError:
                pass  # a worker went away in the meantime
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _worker_main(args: _WorkerArgs, pipe) -> None:
    _exit_with_parent(args.parent_pid)
    pipe.send(_STARTED)
    try:
        config = args.config
        device = config.torch_device(args.rank)
        if device.type == "cpu":
            torch.set_num_threads(args.num_threads)
        group = ParallelGroup.connect(args.rank, config.tensor_parallel_size, args.port, device)
        runner = ModelRunner(config, args.model_config, args.max_model_len, group, args.pool_sizes)
    except BaseException:
        pipe.send(traceback.format_exc())
        return
    pipe.send(_READY)
    while True:
        sched = group.broadcast_object()
        if sched is None:
            return
        runner.execute(sched)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives its engine by at most a second, however the engine's process ended."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
