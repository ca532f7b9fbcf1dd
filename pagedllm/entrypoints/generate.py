"""`pagedllm generate`: complete prompts offline with the engine (the default of `make run`)."""
from __future__ import annotations

import argparse

from pagedllm.paths import DEFAULT_MODEL


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every engine argument as a flag (shared by `generate` and `serve`)."""
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    parser.add_argument("--preemption-policy", default="fcfs", choices=["fcfs", "priority", "shortest_remaining"])
    parser.add_argument("--swap-space", type=int, default=1 << 30, help="bytes")
    parser.add_argument("--seed", type=int, default=0)


ENGINE_ARG_NAMES = (
    "dtype", "block_size", "num_kv_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len", "enable_prefix_caching", "enable_chunked_prefill", "preemption_mode",
    "preemption_policy", "swap_space", "seed",
)


def engine_args_from(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline")
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--n", type=int, default=1)
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_args_from(args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    for output in llm.generate(args.prompt, params):
        for completion in output.outputs:
            print(f"--- {output.prompt!r} [{completion.finish_reason}]")
            print(output.prompt + completion.text)
    return 0
