"""`pagedllm bench lora --against vllm`: the argument handling and the worker protocol, without
vLLM. The vLLM run itself is a benchmark (docs/benchmarks.md); here a stand-in worker, started
through a stand-in "vLLM Python", answers the orders as bench/vllm_worker.py does, so what the
bench sends (which requests, which adapter for each) and what it makes of the answers is checked."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.bench import lora, vllm_cpu, vllm_worker
from pagedllm.bench.workload import Workload
from pagedllm.cli import main

FAKE_WORKER = """
import json, sys
sys.path.insert(0, {worker_dir!r})
import vllm_worker
workload_path, dtype = sys.argv[3], sys.argv[4]
workload = json.load(open(workload_path))
log = open({log!r}, "a")
log.write(json.dumps({{"dtype": dtype, "lora": workload.get("lora")}}) + "\\n")
vllm_worker.say({{"ready": True, "dtype": "float32", "load_seconds": 0.0, "version": "stand-in"}})
for line in sys.stdin:
    order = vllm_worker.parse_run(line, len(workload["prompts"]))
    if order is None:
        break
    count, adapters = order
    log.write(json.dumps({{"count": count, "adapters": adapters}}) + "\\n")
    log.flush()
    produced = sum(workload["output_lens"][:count]) - {short_by}
    vllm_worker.say({{"seconds": 2.0, "cpu_seconds": 4.0, "produced": produced}})
"""


def stand_in_python(tmp_path: Path, short_by: int = 0) -> tuple[Path, Path]:
    """An executable that VllmCpu starts as `PYTHON vllm_worker.py FOLDER WORKLOAD DTYPE`; it runs
    the stand-in worker instead, logging the workload's LoRA entry and every order."""
    log = tmp_path / "orders.jsonl"
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER.format(worker_dir=str(Path(vllm_worker.__file__).parent), log=str(log),
                                         short_by=short_by))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {worker} "$@"\n')
    python.chmod(0o755)
    return python, log


def bench_args(**changes) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    lora.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in changes.items()])


def test_default_bench_lora_runs_our_engine_alone():
    args = bench_args()
    assert args.against == "none" and args.vllm_python is None and args.vllm_dtype == "auto"
    assert bench_args(against="vllm", vllm_dtype="float32").vllm_dtype == "float32"
    with pytest.raises(SystemExit):
        bench_args(against="llama.cpp")


def test_against_vllm_without_its_venv_is_refused_before_anything_loads(monkeypatch):
    from pagedllm.config import ModelConfig

    def loaded(*args, **kwargs):
        raise AssertionError("the model was read before the refusal")

    monkeypatch.delenv(vllm_cpu.PYTHON_ENV, raising=False)
    monkeypatch.setattr(ModelConfig, "from_pretrained", loaded)
    monkeypatch.setattr(lora, "write_adapters", loaded)
    with pytest.raises(SystemExit, match="--vllm-python"):
        main(["bench", "lora", "--against", "vllm"])
    with pytest.raises(SystemExit, match="--vllm-python"):
        main(["bench", "lora", "--against", "vllm", "--vllm-python", "/no/such/python"])


def test_cases_spread_the_batch_round_robin_and_the_single_stream_takes_the_first_adapter():
    assert lora.case_requests("batch, base", 5, 2) == (5, [None] * 5)
    assert lora.case_requests("batch, adapters", 5, 2) == (5, [0, 1, 0, 1, 0])
    assert lora.case_requests("single, base", 5, 2) == (1, [None])
    assert lora.case_requests("single, adapter", 5, 2) == (1, [0])


def test_the_worker_reads_plain_runs_and_orders_with_adapters():
    assert vllm_worker.parse_run("run\n", 3) == (3, [None, None, None])
    assert vllm_worker.parse_run('{"count": 2, "adapters": [1, null]}\n', 3) == (2, [1, None])
    assert vllm_worker.parse_run('{"count": 1}', 3) == (1, [None])
    assert vllm_worker.parse_run("quit\n", 3) is None and vllm_worker.parse_run("", 3) is None
    for bad in ('{"count": 4}', '{"count": 0}', '{"count": 2, "adapters": [0]}'):
        with pytest.raises(ValueError):
            vllm_worker.parse_run(bad, 3)


def test_the_workers_cpu_seconds_count_its_children():
    burn = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.6: pass\nprint('done', flush=True)\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = vllm_worker.cpu_seconds()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"  # 0.6 CPU seconds burnt by a child still alive
        assert vllm_worker.cpu_seconds() - before >= 0.55
    finally:
        child.kill()
        child.wait()


def test_vllm_side_sends_each_case_with_its_adapters_and_reads_the_answer(tmp_path):
    python, log = stand_in_python(tmp_path)
    args = bench_args(num_requests=4, num_adapters=2, output_len=3, rank=8, vllm_python=python, vllm_dtype="float32")
    paths = [tmp_path / "adapter0", tmp_path / "adapter1"]
    side = lora.VllmLora(str(tmp_path), paths, [[11, 12], [13], [14, 15, 16], [17]], args)
    try:
        assert side.name == "vLLM stand-in CPU (float32)"
        assert side("batch, adapters") == (12 / 2.0, 12 / 4.0)  # 4 requests x 3 tokens in 2 s, 4 CPU-s
        assert side("single, base") == (3 / 2.0, 3 / 4.0)
    finally:
        side.close()
    started, *orders = [json.loads(line) for line in log.read_text().splitlines()]
    assert started == {"dtype": "float32", "lora": {"adapters": [str(p) for p in paths], "max_lora_rank": 8}}
    assert orders == [{"count": 4, "adapters": [0, 1, 0, 1]}, {"count": 1, "adapters": [None]}]


def test_a_run_short_of_the_asked_tokens_is_an_error(tmp_path):
    python, _ = stand_in_python(tmp_path, short_by=1)
    engine = vllm_cpu.VllmCpu(str(python), tmp_path, Workload([[11], [12]], [3, 3]))
    try:
        with pytest.raises(RuntimeError, match="produced 2 tokens, the workload asks for 3"):
            engine.run(1, [None])
    finally:
        engine.close()


def test_both_lora_dtypes_take_turns_and_are_compared(monkeypatch, capsys):
    """`--lora-dtype both`: a float32-pairs engine and a bfloat16 one, each case in turns, and the
    report's ratio of the first to the second (stand-in engines: the wiring, not the speed)."""
    built, order = [], []

    class StandIn:
        def __init__(self, model, paths, prompts, args, lora_dtype="auto"):
            built.append(lora_dtype)
            self.rate = {"float32": 100.0, "bfloat16": 125.0}[lora_dtype]
            self.dtype = lora_dtype

        def __call__(self, case):
            order.append((self.dtype, case))
            return self.rate, self.rate

        def close(self):
            pass

    monkeypatch.setattr(lora, "PagedLora", StandIn)
    monkeypatch.setattr(lora, "write_adapters", lambda *args: [])
    assert lora.run(bench_args(lora_dtype="both", rounds=2, num_requests=2, prompt_len=3)) == 0
    assert built == ["float32", "bfloat16"]
    assert order[:8] == [(d, c) for d in ("float32", "bfloat16") for c in lora.CASES] and len(order) == 16
    out = capsys.readouterr().out
    assert "pagedllm float32 pairs / pagedllm bfloat16 pairs (wall): batch, base 0.80x" in out
    with pytest.raises(SystemExit):
        bench_args(lora_dtype="float16")
