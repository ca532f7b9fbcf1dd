"""LoRA serving: a batch spread over several adapters against the same batch on the base model.

One engine (enable_lora) runs, in turns so that a busier stretch of a shared machine falls on
both: N requests on the base model, then the same N prompts spread round-robin over A adapters
(greedy, fixed output length, prefix caching off so no turn reuses another's prompt KV); then
one request alone with and without an adapter (single stream). Each figure is the best of the
rounds. The adapters are random PEFT-format adapters of rank R on every projection
(q/k/v/o/gate/up/down), written for the model's shapes: their values do not change the cost.

`--against vllm` runs the same four cases through vLLM's CPU backend in its own venv
(bench/vllm_cpu.py; `LLM(enable_lora=True, max_loras=A, max_lora_rank=R)` on the HF folder of a
GGUF file, a `LoRARequest` per request on the same adapter folders), the two engines loaded
throughout and taking turns each round; it reports both engines' adapters/base ratios and ours
against vLLM's with adapters.

`--lora-dtype both` loads two of our engines, the adapters' pairs in float32 and in bfloat16
(EngineConfig.lora_dtype), taking turns the same way: the A/B of the pairs' dtype in one run.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.config.engine import LORA_DTYPES

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=16, help="requests of the batch (default: %(default)s)")
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters the batch is spread over (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each, the best reported (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    parser.add_argument("--against", choices=("none", "vllm"), default="none",
                        help="vllm: the same workload through vLLM's CPU backend too, taking turns (--vllm-python)")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vLLM's CPU build (default $PAGEDLLM_VLLM_PYTHON)")
    parser.add_argument("--vllm-dtype", default="auto", help="vLLM's dtype (auto: its choice, bfloat16 where the CPU has it)")
    parser.add_argument("--lora-dtype", choices=(*LORA_DTYPES, "both"), default="auto",
                        help="our adapters' pair dtype (vLLM's lora_dtype); both: a float32 engine and a bfloat16 one "
                             "taking turns, compared (default: %(default)s)")


def write_adapters(model_config, count: int, rank: int, folder: Path, b_std: float = 0.01) -> list[Path]:
    """`count` random adapters for the model's shapes (PEFT's format, adapters/peft_format.py): A
    of unit-variance outputs, B of standard deviation `b_std` (scaling 2)."""
    from pagedllm.adapters.peft_format import LoraSettings, save_adapter

    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    g = torch.Generator().manual_seed(0)
    paths = []
    for index in range(count):
        tensors = {}
        for layer in range(c.num_layers):
            for name, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"model.layers.{layer}.{part}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * b_std
        paths.append(save_adapter(folder / f"adapter{index}", LoraSettings(rank, 2.0 * rank, 0.0, TARGETS), "bench", tensors))
    return paths


CASES = ("batch, base", "batch, adapters", "single, base", "single, adapter")


def case_requests(case: str, num_requests: int, num_adapters: int) -> tuple[int, list[int | None]]:
    """(how many of the prompts, the adapter index of each or None for the base) of a case."""
    count = num_requests if case.startswith("batch") else 1
    with_adapters = not case.endswith("base")
    return count, [i % num_adapters if with_adapters else None for i in range(count)]


def _timed(llm, prompts, params, loras) -> tuple[float, float]:
    """Output tokens per second of one generate call: per wall-clock second, and per CPU second
    of this process (what a shared machine's co-runners disturb least: time spent descheduled
    is not counted)."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / wall, tokens / cpu


class PagedLora:
    """Our engine with the adapters enabled, loaded once; each call times one case."""

    def __init__(self, model: str, paths: list[Path], prompts: list[list[int]], args: argparse.Namespace,
                 lora_dtype: str = "auto"):
        from pagedllm import LLM, LoRARequest, SamplingParams

        self.llm = LLM(model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
                       enable_prefix_caching=False, max_num_seqs=max(args.num_requests, 1), lora_dtype=lora_dtype)
        self.prompts = [{"prompt_token_ids": p} for p in prompts]
        self.loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.args = args
        spread = [self.loras[i % len(self.loras)] for i in range(2)]
        _timed(self.llm, self.prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), spread)  # warm-up

    def __call__(self, case: str) -> tuple[float, float]:
        count, adapters = case_requests(case, self.args.num_requests, self.args.num_adapters)
        loras = None if adapters[0] is None else [self.loras[i] for i in adapters]
        return _timed(self.llm, self.prompts[:count], self.params, loras)

    def close(self) -> None:
        self.llm.llm_engine.shutdown()


class VllmLora:
    """vLLM's CPU backend on the same adapters and prompts (bench/vllm_cpu.py's worker)."""

    def __init__(self, model: str, paths: list[Path], prompts: list[list[int]], args: argparse.Namespace):
        from pagedllm.bench import vllm_cpu
        from pagedllm.bench.dequantized import dequantized_folder
        from pagedllm.bench.workload import Workload

        python = vllm_cpu.python_of(args.vllm_python)
        folder = dequantized_folder(Path(model)) if Path(model).is_file() else Path(model)
        workload = Workload(prompts, [args.output_len] * len(prompts))
        lora = {"adapters": [str(p) for p in paths], "max_lora_rank": args.rank}
        self.engine = vllm_cpu.VllmCpu(python, folder, workload, args.vllm_dtype, lora=lora)
        self.name = f"vLLM {self.engine.info['version']} CPU ({self.engine.info['dtype']})"
        self.args = args

    def __call__(self, case: str) -> tuple[float, float]:
        count, adapters = case_requests(case, self.args.num_requests, self.args.num_adapters)
        answer = self.engine.run(count, adapters)
        return answer["produced"] / answer["seconds"], answer["produced"] / answer["cpu_seconds"]

    def close(self) -> None:
        self.engine.close()


def run(args: argparse.Namespace) -> int:
    from pagedllm.config import ModelConfig
    from pagedllm.paths import default_model

    model = str(args.model or default_model())
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.against == "vllm":
        from pagedllm.bench import vllm_cpu

        vllm_cpu.python_of(args.vllm_python)  # refused before anything is loaded
    config = ModelConfig.from_pretrained(model)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, config.vocab_size - 10) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    engines: dict[str, PagedLora | VllmLora] = {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-lora-") as tmp:
        paths = write_adapters(config, args.num_adapters, args.rank, Path(tmp))
        try:
            for lora_dtype in ("float32", "bfloat16") if args.lora_dtype == "both" else (args.lora_dtype,):
                name = "pagedllm" if args.lora_dtype != "both" else f"pagedllm {lora_dtype} pairs"
                engines[name] = PagedLora(model, paths, prompts, args, lora_dtype)
            if args.against == "vllm":
                other = VllmLora(model, paths, prompts, args)
                engines[other.name] = other
            runs = {name: {case: [] for case in CASES} for name in engines}
            for round_ in range(args.rounds):
                for name, engine in engines.items():
                    for case in CASES:
                        runs[name][case].append(engine(case))
                        wall, cpu = runs[name][case][-1]  # as it goes: a run cut short still tells
                        print(f"round {round_ + 1}, {name}, {case}: {wall:.1f} tok/s wall, {cpu:.1f} tok/CPU-s",
                              file=sys.stderr, flush=True)
        finally:
            for engine in engines.values():
                engine.close()
    print(f"{Path(model).name}: {args.num_requests} requests over {args.num_adapters} adapters of rank {args.rank} "
          f"(all 7 projections), prompt {args.prompt_len}, output {args.output_len}, {torch.get_num_threads()} threads, "
          f"best of {args.rounds} rounds in turns")
    for name, cases in runs.items():
        report(name if len(runs) > 1 else None, cases)
    if len(runs) > 1:
        compare(runs)
    return 0


def _best(values: list[tuple[float, float]], index: int) -> float:
    return max(v[index] for v in values)


def report(name: str | None, runs: dict[str, list[tuple[float, float]]]) -> None:
    """One engine's figures: each case's best tok/s (wall and CPU), then its adapters/base ratios."""
    if name:
        print(f"{name}:")
    for label, values in runs.items():
        print(f"{label + ':':18s} {_best(values, 0):7.1f} tok/s wall, {_best(values, 1):7.1f} tok/CPU-s  "
              f"(wall each: {', '.join(f'{v[0]:.1f}' for v in values)})")
    for kind, index in (("wall", 0), ("CPU", 1)):
        best = {label: _best(values, index) for label, values in runs.items()}
        print(f"{kind:4s}: batch with adapters / base {best['batch, adapters'] / best['batch, base']:.2f}x (target >= 0.80x), "
              f"single with adapter / base {best['single, adapter'] / best['single, base']:.2f}x (target >= 0.85x)")


def compare(runs: dict[str, dict[str, list[tuple[float, float]]]]) -> None:
    """The first engine against each other one (another pair dtype, vLLM), each case with
    adapters and on the base."""
    (ours, mine), *others = list(runs.items())
    for name, theirs in others:
        for kind, index in (("wall", 0), ("CPU", 1)):
            ratios = ", ".join(f"{case} {_best(mine[case], index) / _best(theirs[case], index):.2f}x" for case in CASES)
            print(f"{ours} / {name} ({kind}): {ratios}")
