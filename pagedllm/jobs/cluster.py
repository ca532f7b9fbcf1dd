"""Measured status of this node for /v1/cluster: devices, utilisation, memory.

Devices are GPUs when torch sees any, else CPU worker slots (--train-slots, default the CPU cores this
process may run on). Utilisation comes from psutil (CPU) or NVML through torch (GPU); nothing is
estimated. This is the view of a server that runs jobs on its own node; with `--cluster ray` the
nodes are Ray's (ray_cluster.py).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import psutil

from pagedllm.jobs.schemas import ClusterNode, ClusterStatus

GIB = 1024 ** 3


@dataclass(frozen=True)
class Devices:
    kind: str  # "cuda" or "cpu"
    count: int  # GPUs, or CPU cores available to this process


def detect_devices() -> Devices:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return Devices("cuda", torch.cuda.device_count())
    return Devices("cpu", len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def default_slots() -> int:
    """--train-slots default: one per GPU, else one per CPU core."""
    return detect_devices().count


class ClusterMonitor:
    """Samples utilisation on the service's clock (psutil's CPU percentage is "since the last call")."""

    SAMPLE_EVERY_S = 1.0

    def __init__(self, slots: int, devices: Devices | None = None) -> None:
        self.slots = slots
        self.devices = devices or detect_devices()
        self.node_id = socket.gethostname()
        self._cpu = psutil.cpu_percent(None) / 100
        self._sampled = time.monotonic()

    def sample(self) -> None:
        if time.monotonic() - self._sampled >= self.SAMPLE_EVERY_S:
            self._cpu = psutil.cpu_percent(None) / 100
            self._sampled = time.monotonic()

    def utilization(self) -> float:
        if self.devices.kind == "cuda":
            import torch

            try:
                return sum(torch.cuda.utilization(i) for i in range(self.devices.count)) / (100 * self.devices.count)
            except Exception:  # no NVML: fall back to what we can measure
                return self._cpu
        return self._cpu

    def memory(self) -> tuple[list[float], list[float]]:
        """(used, total) in GiB: per GPU, or the node's RAM as one entry."""
        if self.devices.kind == "cuda":
            import torch

            pairs = [torch.cuda.mem_get_info(i) for i in range(self.devices.count)]
            return [(total - free) / GIB for free, total in pairs], [total / GIB for _, total in pairs]
        vm = psutil.virtual_memory()
        return [(vm.total - vm.available) / GIB], [vm.total / GIB]

    def status(self, used_slots: int, active_jobs: int, pending_jobs: int) -> ClusterStatus:
        used, total = self.memory()
        return ClusterStatus(
            device_type=self.devices.kind, total_gpus=self.slots, available_gpus=max(0, self.slots - used_slots),
            gpu_utilization=round(self.utilization(), 4), memory_utilization=round(sum(used) / sum(total), 4),
            active_jobs=active_jobs, pending_jobs=pending_jobs,
        )

    def nodes(self, used_slots: int) -> list[ClusterNode]:
        used, total = self.memory()
        return [ClusterNode(
            node_id=self.node_id, gpus=self.slots, device_type=self.devices.kind,
            status="busy" if used_slots >= self.slots else "ready",
            gpu_memory_used=[round(x, 3) for x in used], memory_total=[round(x, 3) for x in total],
            hostname=self.node_id, cpus=float(os.cpu_count() or 1),
            gpu_count=float(self.devices.count if self.devices.kind == "cuda" else 0),
            free_slots=max(0, self.slots - used_slots),
        )]
