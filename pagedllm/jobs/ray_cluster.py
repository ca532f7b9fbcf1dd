"""Ray as the job service's cluster backend (`pagedllm serve --cluster ray[://ADDRESS]`).

A job is one Ray placement group of world-size bundles (one CPU each, or one GPU each on a cluster
with GPUs), strategy PACK: Ray reserves all of them at once or none, filling nodes before it spreads
over more. Each bundle holds one actor (rank_process.RankProcess) that starts the trainer's entry
point as a child with torch.distributed's environment: rank 0's node address and a port free there
(asked of rank 0's actor by the service), gloo on CPU and NCCL on GPU as the trainer chooses. Ranks are
numbered node by node, so the ranks of a node are consecutive (tensor-parallel groups stay inside a
node); each rank's CUDA_VISIBLE_DEVICES lists the GPUs of its node's ranks, LOCAL_RANK picks its own.

The service polls each actor with non-blocking `ray.wait`: log lines and events come back into the
job's train.log and events.jsonl (so the existing monitor reads them), exit codes end the run, and an
actor that dies with its node (Ray's ActorDiedError) names the node in the job's failure. Utilisation
and memory are measured on each node by a probe actor that holds no resources.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


log = logging.getLogger("pagedllm.jobs")

NAMESPACE = "pagedllm"
GIB = 1024 ** 3
PROBE_EVERY_S = 1.0
CLOSE_TIMEOUT_S = 10.0


def ray_address(cluster: str) -> str:
    """`--cluster` to what ray.init takes: `ray` is the cluster this machine belongs to ($RAY_ADDRESS, else
    the one `ray start` left here), `ray://HOST:PORT` a Ray Client address, passed on as it is."""
    if cluster == "ray":
        return "auto"
    if cluster.startswith("ray://") and len(cluster) > len("ray://"):
        return cluster
    raise ValueError(f"--cluster must be 'ray' or 'ray://HOST:PORT', got {cluster!r}")


def connect(address: str) -> None:
    """Join the Ray cluster as a driver (once per process; the serving replicas share the connection)."""
    import ray

    if ray.is_initialized():
        return
    handler = signal.getsignal(signal.SIGTERM)  # ray.init replaces it with sys.exit: uvicorn's must stay
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Ray's note on a future default of CUDA_VISIBLE_DEVICES
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


@dataclass
class Rank:
    """One rank of a running job: its actor, where it runs, and how it ended."""

    rank: int
    actor: Any
    node_id: str
    address: str
    host: str
    pid: int | None = None
    exit_code: int | None = None
    lost: str | None = None  # why Ray lost the actor, if it did
    node_dead: bool = False  # Ray has marked the rank's node dead
    pending: Any = None  # the outstanding drain() call

    @property
    def ended(self) -> bool:
        return self.exit_code is not None or self.lost is not None


@dataclass
class Starting:
    """A run whose ranks are not all started yet: the actors' answers it waits for, without blocking."""

    config: dict
    args: list[str]
    tags: dict[str, str]
    where: list[Any]  # describe() of each actor
    port: Any  # free_port() of rank 0's actor
    started: list[Any] | None = None  # start() of each actor, once the rendezvous is known


class RayRun:
    """The ranks of one run of a job, as the service's tick sees them. Starting takes three ticks or more
    (actors placed and described, a port free at rank 0's node, the ranks started): nothing waits."""

    def __init__(self, job_id: str, group: Any, ranks: list[Rank], log_path: Path, events_path: Path) -> None:
        self.job_id, self.group, self.ranks = job_id, group, ranks
        self.log_path, self.events_path = log_path, events_path
        self.first_failure_at: float | None = None  # monotonic: a rank failed or was lost; the rest follow soon
        self.starting: Starting | None = None

    def begin(self, config: dict, args: list[str], tags: dict[str, str]) -> None:
        self.starting = Starting(config, args, tags, [r.actor.describe.remote() for r in self.ranks],
                                 self.ranks[0].actor.free_port.remote())

    def _advance_start(self) -> None:
        """Describe -> rendezvous -> start, one stage per tick once the stage's answers are all in."""
        import ray

        s = self.starting
        refs = s.started if s.started is not None else [*s.where, s.port]
        if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            return
        try:
            values = ray.get(refs)
        except Exception as exc:  # an actor that could not be placed or started
            self._start_failed(exc)
            return
        if s.started is None:
            envs = rank_environments(values[:-1], values[-1], s.tags)
            s.started = [r.actor.start.remote(s.config, s.args, env) for r, env in zip(self.ranks, envs)]
            return
        for rank, pid in zip(self.ranks, values):
            rank.pid = pid
        self.starting = None

    def _start_failed(self, exc: Exception) -> None:
        text = str(exc).strip().splitlines()
        for rank in self.ranks:
            if not rank.ended:
                rank.lost = f"not started: {text[0] if text else type(exc).__name__}"
        self.starting = None
        self._failed()

    @property
    def ended(self) -> bool:
        return all(r.ended for r in self.ranks)

    def poll(self) -> None:
        """Take in what the ranks wrote and how they ended; never blocks."""
        import ray

        if self.starting is not None:
            return self._advance_start()
        for rank in self.ranks:
            if rank.pending is None and not rank.ended:
                rank.pending = rank.actor.drain.remote()
        waiting = [r.pending for r in self.ranks if r.pending is not None]
        if not waiting:
            return
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        ready = set(ready)
        for rank in self.ranks:
            if rank.pending is not None and rank.pending in ready:
                self._take(rank)

    def _take(self, rank: Rank) -> None:
        import ray
        from ray.exceptions import RayActorError

        ref, rank.pending = rank.pending, None
        try:
            out = ray.get(ref)
        except RayActorError as exc:
            text = str(exc).strip().splitlines()
            rank.lost = f"its actor died: {text[0] if text else type(exc).__name__}"
            self.check_nodes()
            self._failed()
            return
        if out["log"]:
            with open(self.log_path, "ab") as file:
                file.write(b"".join(b"[rank %d] " % rank.rank + line + b"\n" for line in out["log"].splitlines()))
        if out["events"]:
            with open(self.events_path, "ab") as file:
                file.write(out["events"])
        if out["exit_code"] is not None:
            rank.exit_code = out["exit_code"]
            if rank.exit_code != 0:
                self._failed()

    def _failed(self) -> None:
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def signal(self, sig: int) -> None:
        if self.starting is not None:  # not all started: none is left to run (as if signalled at once)
            import ray

            for rank in self.ranks:
                ray.kill(rank.actor)
                rank.exit_code = -int(sig)
            self.starting = None
            return
        for rank in self.ranks:
            if not rank.ended:
                rank.actor.signal.remote(int(sig))

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    @property
    def exit_code(self) -> int:
        """Rank 0's exit code when it exited, else the first non-zero one (1 if only lost ranks)."""
        codes = {r.rank: r.exit_code for r in self.ranks if r.exit_code is not None}
        if 0 in codes and (codes[0] != 0 or len(codes) == len(self.ranks)):
            return codes[0]
        return next((c for c in codes.values() if c != 0), 1 if self.lost else 0)

    @property
    def lost(self) -> list[Rank]:
        return [r for r in self.ranks if r.lost is not None]

    def check_nodes(self) -> bool:
        """Ask Ray whether the nodes of lost ranks are dead now; True when every one of them is."""
        import ray

        dead = {n["NodeID"]: n.get("DeathReasonMessage") or "no reason given" for n in ray.nodes() if not n["Alive"]}
        for rank in self.lost:
            if rank.node_id in dead and not rank.node_dead:
                rank.node_dead, rank.lost = True, f"Ray marked the node dead ({dead[rank.node_id]})"
        return all(r.node_dead for r in self.lost)

    def describe_end(self) -> str:
        """How the run ended, node by node: the dead nodes first (what the job's failure names)."""
        parts = []
        by_node: dict[str, list[Rank]] = {}
        for rank in sorted(self.lost, key=lambda r: not r.node_dead):
            by_node.setdefault(rank.node_id, []).append(rank)
        for node_id, ranks in by_node.items():
            r0, names = ranks[0], f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r.rank) for r in ranks)}"
            where = f"node {node_id[:12]} ({r0.address}, {r0.host})"
            parts.append(f"{where} died with {names} on it: {r0.lost}" if r0.node_dead
                         else f"{names} on {where} lost: {r0.lost}")
        failed = [r for r in self.ranks if r.exit_code not in (None, 0)]
        for rank in failed:
            how = f"signal {-rank.exit_code}" if rank.exit_code < 0 else f"code {rank.exit_code}"
            parts.append(f"rank {rank.rank} on node {rank.node_id[:12]} ({rank.address}) exited with {how}")
        return "; ".join(parts) or "every rank exited with code 0"

    def close(self) -> list[Any]:
        """Ask the live ranks' actors to kill what is left and remove their files; the calls to wait for
        before the actors and the bundles go (RayCluster.retire)."""
        return [r.actor.close.remote() for r in self.ranks if r.lost is None]

    def release(self) -> None:
        """The actors and the bundles go back to Ray."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for rank in self.ranks:
            ray.kill(rank.actor)
        remove_placement_group(self.group)


@dataclass
class Placement:
    """A job's reservation: its placement group, created when the job reached the head of the queue."""

    group: Any
    created: float = field(default_factory=time.monotonic)


class RayCluster:
    """The connection, the capacity in job slots, reservations, launches and the nodes' view."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.unit = "CPU"  # the resource one rank takes: "GPU" when the cluster has any
        self.reservations: dict[str, Placement] = {}
        self.probes: dict[str, Any] = {}  # node_id -> the probe actor
        self.probe_refs: dict[str, Any] = {}  # node_id -> its outstanding sample()
        self.samples: dict[str, dict] = {}  # node_id -> its latest sample
        self._probed = 0.0
        self.retiring: list[tuple[RayRun, list[Any], float]] = []  # (run, its close() calls, deadline)

    def open(self) -> None:
        import ray

        connect(self.address)
        self.unit = "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
        # the cluster's own address (GCS), not "auto": which cluster `--cluster ray` found
        joined = getattr(ray.get_runtime_context(), "gcs_address", None) or self.address
        log.info("job service on the Ray cluster at %s: %d %s slots on %d nodes", joined, self.capacity(),
                 self.unit, len(self.live_nodes()))

    @property
    def device_type(self) -> str:
        return "cuda" if self.unit == "GPU" else "cpu"

    # ---- capacity and reservations ----

    def live_nodes(self) -> list[dict]:
        import ray

        return [n for n in ray.nodes() if n["Alive"]]

    def capacity(self) -> int:
        """Rank slots on the live nodes."""
        return sum(int(n["Resources"].get(self.unit, 0)) for n in self.live_nodes())

    def available(self) -> int:
        import ray

        return int(ray.available_resources().get(self.unit, 0))

    def reserve(self, job_id: str, world_size: int, run: int) -> Any | None:
        """The job's placement group once Ray has reserved every bundle (None until then); the first call
        asks for it. Strict FIFO is the caller's: it asks only for the head of the queue."""
        from ray.util import placement_group_table
        from ray.util.placement_group import placement_group

        placement = self.reservations.get(job_id)
        if placement is None:
            group = placement_group([{self.unit: 1}] * world_size, strategy="PACK", name=f"pagedllm-{job_id}-run{run}")
            placement = self.reservations[job_id] = Placement(group)
            log.info("job %s: placement group of %d %s bundles requested", job_id, world_size, self.unit)
        if placement_group_table(placement.group).get("state") != "CREATED":
            return None
        return self.reservations.pop(job_id).group

    def release(self, job_id: str) -> None:
        """Drop a reservation not (yet) launched: the job was cancelled while it waited."""
        placement = self.reservations.pop(job_id, None)
        if placement is not None:
            self.release_group(placement.group)

    @staticmethod
    def release_group(group: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)

    # ---- launching ----

    def launch(self, job_id: str, group: Any, config: dict, args: list[str], environment: dict[str, str],
               log_path: Path, events_path: Path) -> RayRun:
        """One actor per bundle, ranks numbered node by node, rank 0's node and port as the rendezvous."""
        import ray
        from ray.util import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedllm.jobs.rank_process import RankProcess

        bundles = placement_group_table(group)["bundles_to_node_id"]
        order = sorted(bundles, key=lambda b: (list(dict.fromkeys(bundles.values())).index(bundles[b]), b))
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        resources = {"num_gpus": 1, "num_cpus": 0} if self.unit == "GPU" else {"num_cpus": 1}
        remote = ray.remote(RankProcess)
        ranks = []
        for rank, b in enumerate(order):
            actor = remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b),
                                   name=f"pagedllm-{job_id}-rank{rank}", max_concurrency=1, **resources).remote(job_id, rank)
            node = nodes.get(bundles[b], {})
            ranks.append(Rank(rank, actor, bundles[b], node.get("NodeManagerAddress", "?"), node.get("NodeManagerHostname", "?")))
        run = RayRun(job_id, group, ranks, log_path, events_path)
        run.begin(config, args, environment)
        return run

    def retire(self, run: RayRun) -> None:
        """An ended run: its actors clean up on their nodes, then they and its bundles go (in `sample`)."""
        self.retiring.append((run, run.close(), time.monotonic() + CLOSE_TIMEOUT_S))

    def _reap(self) -> None:
        import ray

        for item in list(self.retiring):
            run, refs, deadline = item
            if not refs or len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs) or time.monotonic() > deadline:
                self.retiring.remove(item)
                run.release()

    # ---- nodes ----

    def sample(self) -> None:
        """Keep one probe per live node and one sample in flight per probe (and finish retiring runs);
        never blocks."""
        import ray

        self._reap()
        if time.monotonic() - self._probed < PROBE_EVERY_S:
            return
        self._probed = time.monotonic()
        live = {n["NodeID"]: n for n in self.live_nodes()}
        for node_id in list(self.probes):
            if node_id not in live:
                self.probes.pop(node_id)
                self.probe_refs.pop(node_id, None)
                self.samples.pop(node_id, None)
        for node_id, node in live.items():
            if node_id not in self.probes:
                self.probes[node_id] = start_probe(node_id, node["Resources"].get("GPU", 0) > 0)
        refs = [ref for ref in self.probe_refs.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for node_id, probe in self.probes.items():
            ref = self.probe_refs.get(node_id)
            if ref is not None and ref in ready:
                try:
                    self.samples[node_id] = ray.get(ref)
                except Exception as exc:  # the node is going away: ray.nodes() will say so
                    log.debug("probe of node %s: %s", node_id, exc)
                ref = None
            if ref is None:
                self.probe_refs[node_id] = probe.sample.remote()

    def nodes(self) -> list[dict]:
        """Every node Ray knows, dead ones included, with its resources, free slots and measured load."""
        import ray
        from ray._private.state import available_resources_per_node  # Ray's own per-node view of free resources

        free = available_resources_per_node()
        out = []
        for node in ray.nodes():
            node_id, resources = node["NodeID"], node["Resources"]
            out.append({
                "node_id": node_id, "address": node["NodeManagerAddress"], "hostname": node.get("NodeManagerHostname"),
                "alive": bool(node["Alive"]), "cpus": resources.get("CPU", 0.0), "gpus": resources.get("GPU", 0.0),
                "memory": resources.get("memory", 0.0), "slots": int(resources.get(self.unit, 0)),
                "free_slots": int(free.get(node_id, {}).get(self.unit, 0)) if node["Alive"] else 0,
                "sample": self.samples.get(node_id) if node["Alive"] else None,
            })
        return out

    def close(self) -> None:
        for run, _, _ in self.retiring:
            run.release()
        self.retiring.clear()
        for job_id in list(self.reservations):
            self.release(job_id)
        self.probes.clear()
        self.probe_refs.clear()


def rank_environments(where: list[dict], port: int, tags: dict[str, str]) -> list[dict[str, str]]:
    """torch.distributed's environment for each rank (in rank order): the rendezvous at rank 0's node,
    LOCAL_RANK among the job's ranks on the same node, and that node's GPUs for all of them."""
    by_node: dict[str, list[int]] = {}
    for rank, w in enumerate(where):
        by_node.setdefault(w["node_id"], []).append(rank)
    envs = []
    for rank, w in enumerate(where):
        local = by_node[w["node_id"]]
        env = {"MASTER_ADDR": where[0]["address"], "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(len(where)), "LOCAL_RANK": str(local.index(rank)), "LOCAL_WORLD_SIZE": str(len(local)),
               "GROUP_RANK": str(list(by_node).index(w["node_id"])), **tags}
        gpus = [g for r in local for g in where[r]["gpu_ids"]]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        envs.append(env)
    return envs


class NodeProbe:
    """Measures one node (what /v1/cluster reports): CPU and RAM from psutil, GPUs through torch."""

    def __init__(self, gpus: bool) -> None:
        import psutil

        self.gpus = gpus
        psutil.cpu_percent(None)

    def sample(self) -> dict:
        import psutil

        vm = psutil.virtual_memory()
        out = {"utilization": psutil.cpu_percent(None) / 100, "memory_used": [(vm.total - vm.available) / GIB],
               "memory_total": [vm.total / GIB]}
        if self.gpus:
            import torch

            pairs = [torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())]
            out["memory_used"] = [(total - free) / GIB for free, total in pairs]
            out["memory_total"] = [total / GIB for _, total in pairs]
            try:
                out["utilization"] = sum(torch.cuda.utilization(i) for i in range(len(pairs))) / (100 * max(1, len(pairs)))
            except Exception:  # no NVML: the CPU figure stands
                pass
        return out


def start_probe(node_id: str, gpus: bool) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
    if gpus:  # sees every GPU of the node without holding one
        options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    return ray.remote(NodeProbe).options(**options).remote(gpus)
