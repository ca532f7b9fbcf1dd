"""The console tests' `pagedllm serve` process and the API calls they check the page against."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedllm.entrypoints.serve import ServerProcess, launch

API_KEY = "sk-test-console"


@dataclass
class ConsoleServer:
    process: ServerProcess
    data_dir: Path
    http: httpx.Client  # with the key

    @classmethod
    def start(cls, args: list[str], root: Path) -> "ConsoleServer":
        os.environ.pop("PAGEDLLM_API_KEY", None)
        data_dir = root / "data"
        process = launch(["--log-level", "warning", "--data-dir", str(data_dir), *args], root / "server.log", timeout=120)
        headers = {"Authorization": f"Bearer {API_KEY}"} if "--api-key" in args else {}
        return cls(process, data_dir, httpx.Client(base_url=process.url, headers=headers, timeout=60))

    @property
    def url(self) -> str:
        return self.process.url

    def stats(self, model: str) -> dict:
        readings = self.http.get("/console/api/stats").json()["models"]
        return next(r for r in readings if r["model"] == model)

    def stop(self) -> None:
        self.http.close()
        code = self.process.stop()
        log = self.process.log.read_text()
        assert code in (0, -signal.SIGTERM), f"server exit code {code}:\n{log[-4000:]}"
        assert "Traceback" not in log, log[-6000:]
