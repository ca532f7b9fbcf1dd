"""Shared by the job service tests: tiny job bodies, a real `pagedllm serve` that can be restarted,
waiting on job states, and finding a job's processes by pid or by the launcher's environment tag."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from pagedllm.entrypoints.serve import ServerProcess, launch
from pagedllm.jobs.launcher import DATA_DIR_ENV, JOB_ID_ENV
from training.helpers import tiny_job

API_KEY = "sk-test-jobs"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


def job_body(paths: dict, ranks: int = 2, steps: int = 100, **sections) -> dict:
    """A tiny job (a few thousand parameters) for `ranks` processes; checkpoint_dir left to the service
    unless the sections give one."""
    body = tiny_job(paths, "unused", optimization_config={"total_steps": steps, "warmup_steps": 2},
                    parallelism_config={"data_parallel_size": ranks}, **sections)
    if "checkpoint_dir" not in sections.get("checkpoint_config", {}):
        del body["checkpoint_config"]["checkpoint_dir"]
    return body


def to_toml(body: dict) -> str:
    """A job body as a TOML job file: top-level values, then one table per section. Enough for job
    bodies (strings, numbers, booleans, lists of them; None values left out); JSON's scalar syntax is
    TOML's for these."""
    top = [f"{key} = {json.dumps(value)}" for key, value in body.items() if not isinstance(value, dict) and value is not None]
    tables = [f"\n[{key}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in value.items() if v is not None)
              for key, value in body.items() if isinstance(value, dict)]
    return "\n".join(top) + "\n" + "".join(tables)


class JobServer:
    """`pagedllm serve` (no model) on 127.0.0.1 with a data dir and an API key; restartable."""

    def __init__(self, data_dir: Path, slots: int, logs: Path, allowed: tuple[Path, ...] = (), extra: tuple[str, ...] = ()) -> None:
        self.data_dir, self.slots, self.logs = data_dir, slots, logs
        self.allowed = allowed  # --allowed-path roots besides the data dir
        self.extra = extra  # more `pagedllm serve` flags (e.g. --cluster ray)
        self.process: ServerProcess | None = None
        self.starts = 0
        self.client: httpx.Client | None = None

    def start(self) -> JobServer:
        os.environ.pop("PAGEDLLM_API_KEY", None)
        self.starts += 1
        args = ["--log-level", "warning", "--no-model", "--api-key", API_KEY, "--data-dir", str(self.data_dir),
                "--train-slots", str(self.slots), *(arg for root in self.allowed for arg in ("--allowed-path", str(root))), *self.extra]
        self.process = launch(args, self.logs / f"server-{self.starts}.log", timeout=120)
        self.client = httpx.Client(base_url=self.process.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        return self

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.process is not None:
            code = self.process.stop()
            log = self.process.log.read_text()
            self.process = None
            assert code in (0, -signal.SIGTERM), f"server exit code {code}:\n{log[-4000:]}"
            assert "Traceback" not in log, log[-6000:]

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def url(self) -> str:
        return self.process.url

    def job(self, job_id: str) -> dict:
        response = self.client.get(f"/v1/training/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def submit(self, body: dict) -> str:
        response = self.client.post("/v1/training/jobs", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "PENDING"
        return response.json()["job_id"]

    def wait(self, job_id: str, predicate, timeout: float = 180, what: str = "") -> dict:
        """Poll the job until predicate(view) holds; fail on timeout or on an unexpected terminal state."""
        deadline = time.monotonic() + timeout
        while True:
            view = self.job(job_id)
            if predicate(view):
                return view
            assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}: {_summary(view)}"
            time.sleep(0.2)

    def wait_status(self, job_id: str, status: str, timeout: float = 180) -> dict:
        def reached(view: dict) -> bool:
            assert view["status"] == status or view["status"] not in TERMINAL, f"job ended {_summary(view)}"
            return view["status"] == status

        return self.wait(job_id, reached, timeout, f"status {status}")

    def wait_step(self, job_id: str, step: int, timeout: float = 180) -> dict:
        def reached(view: dict) -> bool:
            assert view["status"] not in TERMINAL, f"job ended before step {step}: {_summary(view)}"
            return (view["metrics"]["step"] or 0) >= step

        return self.wait(job_id, reached, timeout, f"step {step}")


def _summary(view: dict) -> str:
    return f"{view['status']} step {view['metrics']['step']} reason {view['failure_reason']} history {view['history']}"


def alive(pid: int) -> bool:
    """A live process (zombies awaiting their parent's wait() count as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def job_pids(view: dict) -> list[int]:
    """The launcher (torchrun) and every rank of the job's current run."""
    return [view["pid"], *(p["pid"] for p in view["processes"])]


def tagged(key: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment has key=value (how the launcher marks a job's processes)."""
    found = []
    for proc in psutil.process_iter(["environ", "status"]):
        if (proc.info.get("environ") or {}).get(key) == value and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def job_processes(job_id: str) -> list[psutil.Process]:
    return tagged(JOB_ID_ENV, job_id)


@contextmanager
def no_job_processes_left(data_dir: Path, stop: Callable[[], None]) -> Iterator[None]:
    """At exit: `stop()` the server, SIGKILL any process of its jobs, and fail if there was one."""
    try:
        yield
    finally:
        try:
            stop()
        finally:
            leftovers = kill_leftovers(data_dir)
        assert not leftovers, f"job processes left behind: {leftovers}"


def kill_leftovers(data_dir: Path) -> list[int]:
    """SIGKILL every process launched for jobs of this data dir; the pids found (for a failing check)."""
    procs = tagged(DATA_DIR_ENV, str(data_dir.resolve()))
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


def stand_in(job_id: str, data_dir: Path, script: str) -> subprocess.Popen:
    """A shell tagged like a job's launcher (its processes are found and killed as the job's), playing a
    job where what is tested is the service's own behaviour."""
    env = {**os.environ, JOB_ID_ENV: job_id, DATA_DIR_ENV: str(data_dir)}
    return subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True)


def assert_error(response: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    """An OpenAI-shaped error with this status (and param, and message text)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    assert contains in error["message"], error
    return error
