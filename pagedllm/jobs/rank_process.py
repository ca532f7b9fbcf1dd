"""One training rank on a Ray node: the body of the actor the Ray backend places in a job's bundle.

The actor does not train in its own process: it starts the same entry point torchrun starts
(`python -m pagedllm.training.worker --config job.json ...`) as a child with torch.distributed's
environment (MASTER_ADDR/MASTER_PORT of rank 0, RANK, WORLD_SIZE, LOCAL_RANK), so a rank behaves
exactly as under torchrun: its own main thread for signal handlers (SIGTERM = stop at the next step
boundary and checkpoint), its own exit code, nothing of Ray's worker state in the trainer.

The child dies with the actor (PR_SET_PDEATHSIG from the thread that waits on it, which lives as
long as the child), so a node that dies, or an actor Ray kills, leaves no rank behind. Its output
and its events file stay on the node; the service drains both through `drain()` (complete lines
only) into the job's train.log and events.jsonl, so the data dir need not be shared — only the
checkpoint_dir, dataset and tokenizer must be on a path every node sees.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RankProcess:
    """A rank's child process and what it wrote since the last drain."""

    def __init__(self, job_id: str, rank: int) -> None:
        self.job_id, self.rank = job_id, rank
        self.dir = Path(tempfile.mkdtemp(prefix=f"pagedllm-{job_id[:8]}-rank{rank}-"))
        self.log, self.events = self.dir / "train.log", self.dir / "events.jsonl"
        self.offsets = {"log": 0, "events": 0}
        self.popen: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.start_error: str | None = None
        self._started = threading.Event()

    def describe(self) -> dict:
        """Where this rank runs: Ray node id, the node's address, host name and the GPUs Ray gave it."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        """A port free on this node now (rank 0's actor is asked for the rendezvous port)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(self, config: dict, args: list[str], env: dict[str, str]) -> int:
        """Start the rank: the job's config written here, `args` after it; returns the child's pid."""
        path = self.dir / "job.json"
        path.write_text(json.dumps(config))
        command = [sys.executable, "-m", "pagedllm.training.worker", "--config", str(path),
                   "--events-file", str(self.events), *args]
        threading.Thread(target=self._run, args=(command, {**os.environ, **env}), daemon=True,
                         name=f"rank{self.rank}").start()
        self._started.wait()
        if self.popen is None:
            raise RuntimeError(f"rank {self.rank} could not start: {self.start_error}")
        return self.popen.pid

    def _run(self, command: list[str], env: dict[str, str]) -> None:
        """Start the child and wait for it on this thread (the child's PDEATHSIG is tied to it)."""
        try:
            with open(self.log, "ab") as out:
                self.popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            self.start_error = str(exc)
            self._started.set()
            return
        self._started.set()
        self.exit_code = self.popen.wait()

    def drain(self) -> dict:
        """New complete lines of the log and of the events file, and the exit code once it has exited
        (taken before the files are read, so nothing written before the exit is missed)."""
        exit_code = self.exit_code
        return {"log": self._read("log", self.log), "events": self._read("events", self.events), "exit_code": exit_code}

    def _read(self, key: str, path: Path) -> bytes:
        try:
            with open(path, "rb") as file:
                file.seek(self.offsets[key])
                data = file.read()
        except FileNotFoundError:
            return b""
        end = data.rfind(b"\n") + 1
        self.offsets[key] += end
        return data[:end]

    def signal(self, sig: int) -> bool:
        """`sig` to the rank's process group; False if it has exited."""
        if self.popen is None or self.popen.poll() is not None:
            return False
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        """Kill the rank if it still runs and remove its files (the service has drained them)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
