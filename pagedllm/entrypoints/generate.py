"""`pagedllm generate`: complete prompts offline with the engine (the default of `make run`)."""
from __future__ import annotations

import argparse
import logging

from pagedllm.entrypoints.engine_args import add_engine_arguments, engine_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts offline")
    parser.add_argument("--model", help="a Hugging Face folder or a GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help='tokens to generate per prompt (default: %(default)s)')
    parser.add_argument("--temperature", type=float, default=0.0, help='sampling temperature; 0 is greedy (default: %(default)s)')
    parser.add_argument("--top-p", type=float, default=1.0, help='nucleus sampling: keep the smallest set of tokens with this much probability (default: %(default)s)')
    parser.add_argument("--n", type=int, default=1, help='answers per prompt (default: %(default)s)')
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="info: also what the engine set up (the CPU kernels' build among it)")
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model, **engine_args(args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    prompts = [chat_prompt(llm.get_tokenizer(), p) for p in args.prompt] if args.chat else args.prompt
    for prompt, output in zip(args.prompt, llm.generate(prompts, params)):
        for completion in output.outputs:
            print(f"--- {prompt!r} [{completion.finish_reason}]")
            print(completion.text if args.chat else prompt + completion.text)
    return 0


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as the one user message of a conversation, rendered by the model's chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a model with a chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
