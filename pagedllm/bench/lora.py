"""LoRA serving: a batch spread over several adapters against the same batch on the base model.

One engine (enable_lora) runs, in turns so that a busier stretch of a shared machine falls on
both: N requests on the base model, then the same N prompts spread round-robin over A adapters
(greedy, fixed output length, prefix caching off so no turn reuses another's prompt KV); then
one request alone with and without an adapter (single stream). Each figure is the best of the
rounds. The adapters are random PEFT-format adapters of rank R on every projection
(q/k/v/o/gate/up/down), written for the model's shapes: their values do not change the cost.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

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


def write_adapters(model_config, count: int, rank: int, folder: Path) -> list[Path]:
    """`count` random adapters for the model's shapes (PEFT's format, adapters/peft_format.py)."""
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
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        paths.append(save_adapter(folder / f"adapter{index}", LoraSettings(rank, 2.0 * rank, 0.0, TARGETS), "bench", tensors))
    return paths


def _timed(llm, prompts, params, loras) -> tuple[float, float]:
    """Output tokens per second of one generate call: per wall-clock second, and per CPU second
    of this process (what a shared machine's co-runners disturb least: time spent descheduled
    is not counted)."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / wall, tokens / cpu


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.config import ModelConfig
    from pagedllm.paths import default_model

    model = str(args.model or default_model())
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-lora-") as tmp:
        paths = write_adapters(ModelConfig.from_pretrained(model), args.num_adapters, args.rank, Path(tmp))
        llm = LLM(model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
                  enable_prefix_caching=False, max_num_seqs=max(args.num_requests, 1))
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]}
                   for _ in range(args.num_requests)]
        loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        spread = [loras[i % len(loras)] for i in range(args.num_requests)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        _timed(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), spread[:2])  # warm-up
        runs: dict[str, list[tuple[float, float]]] = {"batch, base": [], "batch, adapters": [], "single, base": [],
                                                      "single, adapter": []}
        for _ in range(args.rounds):
            runs["batch, base"].append(_timed(llm, prompts, params, None))
            runs["batch, adapters"].append(_timed(llm, prompts, params, spread))
            runs["single, base"].append(_timed(llm, prompts[:1], params, None))
            runs["single, adapter"].append(_timed(llm, prompts[:1], params, spread[:1]))
    print(f"{Path(model).name}: {args.num_requests} requests over {args.num_adapters} adapters of rank {args.rank} "
          f"(all 7 projections), prompt {args.prompt_len}, output {args.output_len}, {torch.get_num_threads()} threads, "
          f"best of {args.rounds} rounds in turns")
    for label, values in runs.items():
        print(f"{label + ':':18s} {max(v[0] for v in values):7.1f} tok/s wall, {max(v[1] for v in values):7.1f} tok/CPU-s  "
              f"(wall each: {', '.join(f'{v[0]:.1f}' for v in values)})")
    for kind, index in (("wall", 0), ("CPU", 1)):
        best = {label: max(v[index] for v in values) for label, values in runs.items()}
        print(f"{kind:4s}: batch with adapters / base {best['batch, adapters'] / best['batch, base']:.2f}x (target >= 0.80x), "
              f"single with adapter / base {best['single, adapter'] / best['single, base']:.2f}x (target >= 0.85x)")
    return 0
