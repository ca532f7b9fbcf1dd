"""One training job = one process tree: `pagedllm train --nproc-per-node N` (which becomes torchrun,
or runs the only rank itself when N = 1), started in a session of its own.

Every process of the tree carries the job's id in its environment (PAGEDLLM_JOB_ID, inherited by
torchrun's ranks and anything they start). That tag is how the service finds *all* of a job's
processes: torchrun starts each rank in a new session, so no process group holds the whole job, and
after a server restart the service is no longer the launcher's parent. A pid alone is not an
identity either (pids are reused), so the launcher is remembered as pid + start time.

Stopping a job: SIGTERM to the launcher's process group (torchrun forwards it to the ranks, which stop
at the next step boundary and checkpoint); what is still alive after the grace period gets SIGKILL,
found by the tag.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from pagedllm.training.corpus import ROOTS_ENV
from pagedllm.training.provenance import KEY_ENV, service_key

JOB_ID_ENV = "PAGEDLLM_JOB_ID"
DATA_DIR_ENV = "PAGEDLLM_JOB_DATA_DIR"


@dataclass(frozen=True)
class JobPaths:
    """A job's files in the data dir: <data_dir>/jobs/<job_id>/{job.json, events.jsonl, train.log}."""

    root: Path

    @classmethod
    def of(cls, data_dir: Path, job_id: str) -> JobPaths:
        return cls(Path(data_dir) / "jobs" / job_id)

    @property
    def config(self) -> Path:
        return self.root / "job.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def log(self) -> Path:
        return self.root / "train.log"


@dataclass(frozen=True)
class LaunchSpec:
    job_id: str
    world_size: int
    paths: JobPaths
    data_dir: Path
    resume_from: str | None = None  # a checkpoint_id
    allowed_roots: tuple[Path, ...] = ()  # the folders its dataset files may lead into (links followed)


def train_command(spec: LaunchSpec) -> list[str]:
    command = [sys.executable, "-m", "pagedllm.training.cli", "train", "--config", str(spec.paths.config),
               "--nproc-per-node", str(spec.world_size), "--events-file", str(spec.paths.events)]
    if spec.resume_from:
        command += ["--resume-from", spec.resume_from]
    return command


@dataclass(frozen=True)
class ProcessRef:
    """A process by pid and start time, so that a reused pid is never taken for it."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, psutil.Process(pid).create_time())

    def process(self) -> psutil.Process | None:
        """The live process, or None if it has exited (zombies count as exited) or the pid is reused."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.process() is not None


def job_environment(job_id: str, data_dir: Path, allowed_roots: tuple[Path, ...] = ()) -> dict[str, str]:
    """What every process of a job carries besides its parent's environment (local, or a Ray rank's)."""
    return {JOB_ID_ENV: job_id, DATA_DIR_ENV: str(data_dir), "PYTHONUNBUFFERED": "1",
            KEY_ENV: service_key(data_dir).hex(),  # the job signs its checkpoints with the service's key
            ROOTS_ENV: os.pathsep.join(str(root) for root in allowed_roots or (data_dir,))}


def spawn(spec: LaunchSpec) -> tuple[subprocess.Popen, ProcessRef]:
    """Start the job's launcher in a new session, stdout and stderr appended to its log."""
    env = {**os.environ, **job_environment(spec.job_id, spec.data_dir, spec.allowed_roots)}
    spec.paths.root.mkdir(parents=True, exist_ok=True)
    with open(spec.paths.log, "ab") as log:
        proc = subprocess.Popen(train_command(spec), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        return proc, ProcessRef.of(proc.pid)
    except psutil.NoSuchProcess:  # exited already (and not yet reaped is impossible: we are its parent)
        return proc, ProcessRef(proc.pid, 0.0)


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process tagged with the job's id (never this process itself)."""
    found = []
    for proc in psutil.process_iter(["environ", "status"]):
        env = proc.info.get("environ") or {}
        if env.get(JOB_ID_ENV) == job_id and proc.pid != os.getpid() and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def signal_launcher(launcher: ProcessRef, sig: int) -> bool:
    """`sig` to the launcher's process group (it leads its own session); False if it is gone."""
    if launcher.process() is None:
        return False
    try:
        os.killpg(launcher.pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        os.kill(launcher.pid, sig)
    return True


def kill_all(job_id: str) -> list[int]:
    """SIGKILL every process of the job still alive; the pids signalled."""
    killed = []
    for proc in job_processes(job_id):
        try:
            proc.send_signal(signal.SIGKILL)
            killed.append(proc.pid)
        except psutil.Error:
            pass
    return killed
