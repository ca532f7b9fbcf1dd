"""`pagedllm generate`: complete prompts offline with the engine (the default of `make run`)."""
from __future__ import annotations

import argparse

from pagedllm.entrypoints.engine_args import add_engine_arguments, engine_args
from pagedllm.paths import DEFAULT_MODEL


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

    llm = LLM(args.model, **engine_args(args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    for output in llm.generate(args.prompt, params):
        for completion in output.outputs:
            print(f"--- {output.prompt!r} [{completion.finish_reason}]")
            print(output.prompt + completion.text)
    return 0
