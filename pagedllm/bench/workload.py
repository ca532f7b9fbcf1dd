"""A benchmark's requests: random prompts of random lengths and how many tokens each generates.
Shared by the CPU and GPU offline benchmarks (offline.py, gpu.py)."""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(args.min_prompt, args.max_prompt))] for _ in range(args.num_requests)]
    if args.fixed_output_len:
        lens = [args.fixed_output_len] * args.num_requests
    else:
        lens = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_requests)]
    return Workload(prompts, lens)
