"""Speculative decoding: single-stream (and batched) tokens/s with and without it, in one run.

Workload (--workload, by default chosen by the target): for the default chat model
(`--model` a GGUF file such as SmolLM2-135M-Instruct's, or any folder with a chat template),
chat — varied user questions rendered with the model's chat template (chat_prompts.py), each
answered greedily up to --max-tokens tokens, stopping at EOS as a chat user's answer does; for
the tiny code model, code completion on the Python standard library — prompts are the opening lines of
functions from stdlib modules (files the default model was trained on, as any completion user's
own code base would be), each completed for --max-tokens greedy tokens with ignore_eos. The
target is the default model (models/pagedllm-py-tiny); the draft is models/pagedllm-py-draft,
trained by our trainer, with the same tokenizer, on the target's own continuations of that
corpus (`pagedllm distill`; its prompts are windows anywhere in the files, not these function
heads). Every configuration serves the same requests one at a time (single stream: a user of
`pagedllm serve` at concurrency 1), after a warm-up; with --batch N, N at a time. Greedy
outputs must equal the plain run's (checked). The draft's greedy cycles run fused (one C call
per cycle, spec_decode/fused_cycles.py) unless the engine-driven path is asked for too
(--engine-driven); with --num-scheduler-steps N the plain engine and the fused draft also run N
steps (cycles) per engine step, a pair of its own.

Besides tokens/s over the whole run (the prompts' prefills included), each configuration's decode
rate — tokens after a request's first, over the time from its first token to its last, what a
streaming user sees between tokens (TPOT) — is compared the same way.

The machine's speed drifts by tens of percent from one minute to the next (a shared host), so
the configurations take turns over several rounds, each kept loaded, and a configuration's
speed-up is the median over rounds of its rate against the plain engine's in the same round.
Each round serves prompts no engine has seen twice: first "cold", each prefilled in full, then
"cached", their full blocks found in the prefix cache (on by default, as in vLLM) so that only
the last few tokens are prefilled, as a user re-sending a file's head would; both are reported,
with the decode rate's median over both. By default the draft runs four ways: whole
vocabulary, its 512 most frequent tokens, those with int8 weights, and those with a confidence
floor for its proposals (draft_p_min 0.3: a cycle proposes 0 to k tokens, as many as the draft
is sure of; "mean len", the engine's mean accepted length, counts only the cycles that
proposed) and attending to its last 64 positions only (draft_attention_window).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from pagedllm.bench.chat_prompts import QUESTIONS, chat_prompts
from pagedllm.paths import TINY_MODEL, DRAFT_MODEL

# Every configuration's engine stays loaded, each with this KV budget (~40k tokens of the default
# model; the workload needs at most 8 x 320).
KV_CACHE_MEMORY = 256 << 20
SOURCES = ("argparse.py", "configparser.py", "difflib.py", "pathlib.py", "inspect.py", "typing.py", "ast.py", "shlex.py")


def make_prompts(tokenizer, count: int, prompt_tokens: int, first: int = 0) -> list[list[int]]:
    """The `prompt_tokens` tokens ending at the first line of a function's body, from each file in
    turn: prompts first .. first + count - 1 of a fixed sequence (the same every run; each file
    has at least 10 method heads, so the first 80 prompts differ)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts: list[list[int]] = []
    for index in range(first, first + count):
        text = (stdlib / SOURCES[index % len(SOURCES)]).read_text(encoding="utf-8")
        heads = [m.end() for m in re.finditer(r"\n    def [^\n]*:\n", text)]
        end = heads[((index // len(SOURCES)) * 7 + 3) % len(heads)]
        ids = tokenizer.encode(text[:end])
        prompts.append(ids[-prompt_tokens:])
    return prompts


def make_llm(model: Path, engine_args: dict):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model), kv_cache_memory=KV_CACHE_MEMORY, **engine_args)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # warm-up
    return llm


def run_config(llm, prompts: list[list[int]], max_tokens: int, batch: int, ignore_eos: bool = True) -> dict:
    """One pass over the prompts; tokens/s and the engine's speculation statistics so far."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outputs, decoded, decoding_s = [], 0, 0.0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[first : first + batch]]
        for o in llm.generate(group, params, use_tqdm=False):
            outputs.append(o.outputs[0].token_ids)
            decoded += len(o.outputs[0].token_ids) - 1
            decoding_s += o.metrics.last_token_time - o.metrics.first_token_time
    elapsed = time.perf_counter() - start
    stats = llm.get_stats()
    # tok/s: output tokens over the whole run (prefills included); decode tok/s: tokens after each
    # request's first over the time from its first token to its last (what a streaming user sees
    # between tokens; with batch > 1 the requests' decode times overlap, so it is per request)
    return {"tokens": outputs, "tok_s": sum(map(len, outputs)) / elapsed, "seconds": elapsed,
            "decode_tok_s": decoded / decoding_s if decoding_s > 0 else float("nan"),
            "acceptance": stats.get("spec_decode_acceptance_rate"), "mean_len": stats.get("spec_decode_mean_accepted_length"),
            "draft_share": stats.get("spec_decode_draft_time_share")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=TINY_MODEL,
                        help="target model: a folder or a GGUF file (default: %(default)s)")
    parser.add_argument("--workload", choices=["chat", "code"], default=None,
                        help="chat: questions rendered with the model's chat template; code: stdlib completions "
                             "(default: chat for a model with a chat template, code otherwise)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per round (default: 16 stdlib completions, 8 chat questions)")
    parser.add_argument("--prompt-tokens", type=int, default=192, help='tokens per prompt (default: %(default)s)')
    parser.add_argument("--max-tokens", type=int, default=128, help='tokens generated per prompt (default: %(default)s)')
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help='tokens proposed per step (default: %(default)s)')
    parser.add_argument("--draft-vocab-size", type=int, default=512,
                        help="also run the draft scoring only its N most frequent tokens (0: skip)")
    parser.add_argument("--draft", type=Path, default=None,
                        help=f"draft model folder (default: {DRAFT_MODEL} for the tiny model; required for another target)")
    parser.add_argument("--batch", type=int, default=1, help="requests served at a time (default 1: single stream)")
    parser.add_argument("--disable-by-batch-size", type=int, default=None, metavar="N",
                        help="speculating configurations pause while N or more sequences run (default: never)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, metavar="N",
                        help="also run the plain engine and the fused draft (scoring --draft-vocab-size tokens) with N "
                             "steps (cycles) per engine step (default 1: not)")
    parser.add_argument("--draft-quantization", choices=["int8", "none"], default="int8",
                        help="also run the draft scoring --draft-vocab-size tokens with its weights quantized "
                             "(default: %(default)s; none: skip)")
    parser.add_argument("--draft-p-min", type=float, default=0.3, metavar="P",
                        help="also run the draft scoring --draft-vocab-size tokens (quantized with --draft-quantization) "
                             "proposing only while it gives its token at least P (draft_p_min; default %(default)s, 0: skip)")
    parser.add_argument("--p-min-speculative-tokens", type=int, default=None, metavar="K",
                        help="k of that configuration (default: --num-speculative-tokens)")
    parser.add_argument("--draft-window", type=int, default=64, metavar="W",
                        help="and its draft attending to its last W positions (draft_attention_window; default "
                             "%(default)s, 0: the whole context)")
    parser.add_argument("--engine-driven", action="store_true",
                        help="also run the draft with fused_cycles off (the engine drives every pass)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, the configurations taking turns within each; a round serves --num-prompts new "
                             "prompts twice, cold then cached (default 3; up to 80 prompts in all are distinct)")


# What cuts a draft from a GGUF target (named in the refusal of a target without one).
LAYER_DRAFT_MODULE = "pagedllm.spec_decode.layer_draft"


def run(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import load_tokenizer

    tokenizer = load_tokenizer(str(args.model))
    workload = args.workload or ("chat" if getattr(tokenizer, "chat_template", None) else "code")
    args.num_prompts = args.num_prompts or (8 if workload == "chat" else 16)
    if args.draft is None:
        if args.model.resolve() != TINY_MODEL.resolve():
            print(f"--draft is required for {args.model}: the default draft ({DRAFT_MODEL.name}) shares only the tiny model's "
                  f"tokenizer (cut one from the target with `python -m {LAYER_DRAFT_MODULE} --model {args.model} --out <folder> "
                  "--layers 0,1`, then train it: docs/engine.md, \"a trained draft for the default model\")")
            return 2
        args.draft = DRAFT_MODEL
    if workload == "chat" and args.num_prompts * args.rounds > len(QUESTIONS):
        print(f"note: {args.num_prompts} x {args.rounds} rounds > the {len(QUESTIONS)} chat questions: later rounds repeat some")
    k = args.num_speculative_tokens
    pause = {"disable_by_batch_size": args.disable_by_batch_size} if args.disable_by_batch_size else {}
    draft = {"model": str(args.draft), "num_speculative_tokens": k, **pause}
    reduced = {**draft, "draft_vocab_size": args.draft_vocab_size} if args.draft_vocab_size else draft
    reduced_name = f"draft, {args.draft_vocab_size} tokens" if args.draft_vocab_size else "draft model"
    steps = args.num_scheduler_steps
    quantize = args.draft_quantization != "none"
    p_min_k = args.p_min_speculative_tokens or k
    window = {"draft_attention_window": args.draft_window} if args.draft_window else {}
    windowed = f", window {args.draft_window}" if args.draft_window else ""
    quantization = {"quantization": args.draft_quantization} if quantize else {}
    quantized = f", {args.draft_quantization}" if quantize else ""
    configs = [
        ("no speculation", {}),
        (f"draft model, k={k}", {"speculative_config": draft}),
        *([(f"draft, {args.draft_vocab_size} tokens, k={k}", {"speculative_config": reduced})] if args.draft_vocab_size else []),
        *([(f"{reduced_name}, {args.draft_quantization}", {"speculative_config": {**reduced, "quantization": args.draft_quantization}})]
          if quantize else []),
        *([(f"{reduced_name}{quantized}, p-min {args.draft_p_min:g}{windowed}, k={p_min_k}",
            {"speculative_config": {**reduced, **quantization, "draft_p_min": args.draft_p_min, **window,
                                    "num_speculative_tokens": p_min_k}})]
          if args.draft_p_min else []),
        *([(f"{reduced_name}, engine-driven", {"speculative_config": {**reduced, "fused_cycles": False}})]
          if args.engine_driven else []),
        (f"n-gram, k={k}", {"speculative_config": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                                    **pause}}),
        *([(f"no speculation, {steps} steps", {"num_scheduler_steps": steps}),
           (f"{reduced_name}, {steps} cycles", {"speculative_config": reduced, "num_scheduler_steps": steps})]
          if steps > 1 else []),
    ]
    what = (f"{args.num_prompts} chat questions (the model's template), up to {args.max_tokens} greedy tokens each (to EOS)"
            if workload == "chat" else
            f"{args.num_prompts} stdlib completions of {args.prompt_tokens} prompt tokens, {args.max_tokens} greedy tokens each")
    print(f"target {args.model.name}, draft {args.draft.name}; {what}, {args.batch} at a time, {torch.get_num_threads()} threads; "
          f"{args.rounds} rounds, the configurations taking turns"
          + (f"; speculation pauses at {args.disable_by_batch_size} sequences" if pause else ""))
    llms = [make_llm(args.model, engine_args) for _, engine_args in configs]
    print("target: " + ", ".join(f"{key} {getattr(llms[0].llm_engine.config, key)}"
                                 for key in ("quantization", "int8_activations", "num_scheduler_steps")))
    rounds = []  # per round, per configuration: (cold pass, cached pass)
    for number in range(args.rounds):
        first = number * args.num_prompts
        new = (chat_prompts(tokenizer, args.num_prompts, first) if workload == "chat"
               else make_prompts(tokenizer, args.num_prompts, args.prompt_tokens, first=first))
        rounds.append([tuple(run_config(llm, new, args.max_tokens, args.batch, ignore_eos=workload == "code")
                             for _ in range(2)) for llm in llms])
    print("each round serves prompts new to every engine (cold: each prefilled in full), then the same prompts again "
          "(cached: their full blocks found in the prefix cache, as a re-sent prompt would)")
    print(f"{'configuration':<52} {'tok/s cold':>10} {'cold (median of rounds)':>30} {'cached':>7} "
          f"{'decode speed-up':>16} {'accepted':>9} {'mean len':>9} {'draft time':>11}")
    for index, (name, _) in enumerate(configs):
        def ratios(key: str, which: int) -> list[float]:
            return [r[index][which][key] / r[0][which][key] for r in rounds]

        cold, cached = ratios("tok_s", 0), ratios("tok_s", 1)
        decode = ratios("decode_tok_s", 0) + ratios("decode_tok_s", 1)
        last = rounds[-1][index][1]
        spec = last["acceptance"] is not None
        print(f"{name:<52} {statistics.median(r[index][0]['tok_s'] for r in rounds):10.1f} "
              f"{statistics.median(cold):6.2f}x ({', '.join(f'{x:.2f}' for x in cold)}) {statistics.median(cached):6.2f}x "
              f"{statistics.median(decode):15.2f}x "
              + (f"{last['acceptance']:8.1%} {last['mean_len']:9.2f} {last['draft_share']:10.1%}" if spec else ""))
        if any(r[index][which]["tokens"] != r[0][which]["tokens"] for r in rounds for which in (0, 1)):
            print(f"  !! {name}: greedy tokens differ from the run without speculation")
            return 1
    return 0
