"""A Ray cluster of two nodes on this machine (Ray's own `ray.cluster_utils.Cluster`): a head and a
second node, one CPU each, everything on 127.0.0.1. Started and stopped by the tests; stopping
checks that no raylet, GCS server or Ray worker of it is left.

Every process it starts (and so every Ray worker, and every rank or replica they start) imports this
checkout's `pagedllm` (PYTHONPATH), and the servers the tests start join it through RAY_ADDRESS.
"""
from __future__ import annotations

import os
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
OBJECT_STORE = 80 * 1024 ** 2
SECOND_ADDRESS = "127.0.0.2"  # loopback too
# node death is noticed within ~5 s (Ray's default: ~30 s): 1 s health checks, 5 misses (3 misses of
# 0.5 s marked a live node dead while other test runs loaded this machine)
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5, "health_check_initial_delay_ms": 0}


def cluster_environment() -> dict[str, str]:
    """Loopback only (the variable makes Ray take 127.0.0.1 as this node's address), this checkout first."""
    path = os.environ.get("PYTHONPATH")
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class LocalRayCluster:
    def __init__(self) -> None:
        self._saved = {k: os.environ.get(k) for k in (*cluster_environment(), "RAY_ADDRESS")}
        os.environ.update(cluster_environment())  # before Ray is imported: it reads them once
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
            "num_cpus": 1, "object_store_memory": OBJECT_STORE, "node_ip_address": "127.0.0.1",
            "include_dashboard": False, "_system_config": SYSTEM_CONFIG})
        self.second = self.add_node()
        os.environ["RAY_ADDRESS"] = self.cluster.address
        self.pids: set[int] = set()
        self._remember()

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def add_node(self):
        """The second node, at 127.0.0.2. A driver started on this machine (a server under test) attaches to
        the raylet at the address a node last wrote into the session folder the nodes share here; written
        back to the head's, it attaches to the head and outlives the second node (on real machines each
        node has its own folder)."""
        from ray._private.services import write_node_ip_address

        node = self.cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE, node_ip_address=SECOND_ADDRESS)
        write_node_ip_address(self.cluster.head_node.get_session_dir_path(), "127.0.0.1")
        return node

    def kill_second_node(self) -> str:
        """SIGKILL the second node's raylet (its workers and what they started die with it); its node id."""
        node = self.second
        self._remember()
        raylet = node.all_processes["raylet"][0].process
        node.kill_raylet()
        raylet.wait()  # no zombie left
        return node.node_id

    def replace_second_node(self) -> None:
        """Remove the dead node's remaining processes and start a fresh second node."""
        self.cluster.remove_node(self.second, allow_graceful=False)
        self.second = self.add_node()
        self._remember()

    def _remember(self) -> None:
        """The pids of every process of the cluster now: its nodes' processes and their children (workers)."""
        for node in self.cluster.list_all_nodes():
            for infos in node.all_processes.values():
                for info in infos:
                    self.pids.add(info.process.pid)
        for pid in list(self.pids):
            try:
                self.pids.update(p.pid for p in psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> list[int]:
        """Shut every node down; the pids of processes still alive after that (then killed)."""
        self._remember()
        try:
            self.cluster.shutdown()
        finally:
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        procs = []
        for pid in self.pids:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    procs.append(proc)
            except psutil.NoSuchProcess:
                pass
        gone, alive = psutil.wait_procs(procs, timeout=10)
        for proc in alive:
            proc.kill()
        return [p.pid for p in alive]
