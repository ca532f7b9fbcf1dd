"""Fine-tuning learning check: LoRA on invented facts, judged through the engine on held-out paraphrases.

`pagedllm bench finetune --check` writes a chat dataset teaching facts the base cannot know (where
invented people were born, in invented towns), each asked in three phrasings; a fourth phrasing of
every question is held out. It asks the base model (through the engine, greedy) the held-out
questions, fine-tunes with `pagedllm finetune` (LoRA by default), merges the adapter with
`pagedllm export --merge`, serves the merged folder and asks again. Exact match: the answer's town
appears in the reply. A general question (the capital of France) must still be answered. With
--check the exit code is 1 unless before <= --max-before, after >= --min-after and the general
answer holds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pagedllm.bench.invented_facts import invented_facts
from pagedllm.bench.scratch import scratch_dir

ASKED = ("Where was {p} born?", "In which town was {p} born?", "What is the birthplace of {p}?")
HELD_OUT = "Tell me the town where {p} was born."
GENERAL = ("What is the capital of France?", "Paris")
REPLAY = (("What is the capital of Italy?", "The capital of Italy is Rome."),
          ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
          ("What is 2 + 3?", "2 + 3 = 5."),
          ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
          ("Which planet do we live on?", "We live on Earth."),
          ("What is the largest ocean?", "The Pacific Ocean is the largest ocean."))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="exit 1 unless the model learnt the facts and kept the general one")
    parser.add_argument("--model", default="@default", help="the base: an HF folder, a .gguf file or @default (default: %(default)s)")
    parser.add_argument("--method", default="lora", choices=["lora", "qlora", "full", "both"],
                        help="what trains (default: %(default)s; both = lora and full, with --against)")
    parser.add_argument("--facts", type=int, default=20, help="invented facts in the generated dataset (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: 60; 6 with --against)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="packed rows per step (default: %(default)s)")
    parser.add_argument("--max-seq-len", type=int, default=256, help="tokens per packed row (default: %(default)s)")
    parser.add_argument("--max-before", type=float, default=0.05, help="--check: most the base may already know")
    parser.add_argument("--min-after", type=float, default=0.9, help="--check: least the fine-tuned model must answer")
    parser.add_argument("--work-dir", type=Path, help="keep the dataset, adapter and merged model here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset and the run (default: %(default)s)")
    parser.add_argument("--against", choices=["transformers"], help="instead of the learning check: tokens/s and peak RSS "
                        "against transformers Trainer (+ PEFT), same run, taking turns (bench/finetune_speed.py)")
    parser.add_argument("--rounds", type=int, default=2, help="--against: rounds of turns; the best of each side counts")
    parser.add_argument("--examples", type=int, default=96, help="--against: examples in the generated varied-length dataset")


def write_dataset(facts: list[tuple[str, str]], path: Path) -> Path:
    """The facts in each asked phrasing, and a few ordinary questions answered as the base answers
    them (replay, as fine-tuning recipes mix in general data: without it a few facts drilled for
    many steps teach "X is born in Y" as the answer to everything). The general question the check
    asks is not among them."""
    lines = [{"messages": [{"role": "user", "content": q.format(p=person)},
                           {"role": "assistant", "content": f"{person} was born in {town}."}]}
             for person, town in facts for q in ASKED]
    lines += [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in REPLAY]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def ask(model: str, questions: list[str]) -> list[str]:
    """Greedy replies of the engine serving `model` (a GGUF, a folder, or @default)."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(None if model == "@default" else model, kv_cache_memory=256 << 20, max_model_len=512)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], SamplingParams(temperature=0.0, max_tokens=32))
    return [o.outputs[0].text for o in outputs]


def score(replies: list[str], facts: list[tuple[str, str]]) -> float:
    return sum(town.lower() in reply.lower() for reply, (_, town) in zip(replies, facts)) / len(facts)


def _finetune(args: argparse.Namespace, data: Path, out: Path) -> float:
    from pagedllm.training.cli import main as training_cli

    argv = ["finetune", "--model", args.model, "--data", str(data), "--method", args.method, "--out", str(out),
            "--steps", str(args.steps), "--learning-rate", str(args.learning_rate), "--lora-rank", str(args.lora_rank),
            "--lora-alpha", str(2 * args.lora_rank), "--max-seq-len", str(args.max_seq_len),
            "--batch-size", str(args.batch_size), "--micro-batch-size", str(min(4, args.batch_size)), "--seed", str(args.seed),
            "--peak-flops", "1e12"]  # MFU is not what this bench measures
    began = time.perf_counter()
    if training_cli(argv) != 0:
        raise SystemExit("bench finetune: the fine-tune failed")
    return time.perf_counter() - began


def run(args: argparse.Namespace) -> int:
    if args.against:
        from pagedllm.bench import finetune_speed

        args.steps = args.steps or 6
        return finetune_speed.run(args)
    args.steps = args.steps or 60
    if args.method == "both":
        raise SystemExit("bench finetune: --method both is for --against")
    with scratch_dir("pagedllm-bench-finetune-", args.work_dir) as work:
        return _learning_check(args, work)


def _learning_check(args: argparse.Namespace, work: Path) -> int:
    facts = invented_facts(args.facts, args.seed)
    data = write_dataset(facts, work / "facts.jsonl")
    questions = [HELD_OUT.format(p=person) for person, _ in facts] + [GENERAL[0]]
    before = ask(args.model, questions)
    seconds = _finetune(args, data, work / "tuned")
    served = work / "tuned"
    if args.method != "full":
        from pagedllm.training.cli import main as training_cli

        training_cli(["export", "--adapter", str(work / "tuned"), "--merge", "--out", str(work / "merged")])
        served = work / "merged"
    after = ask(str(served), questions)
    result = {"model": args.model, "method": args.method, "facts": len(facts), "steps": args.steps,
              "finetune_seconds": round(seconds, 1), "exact_match_before": score(before[:-1], facts),
              "exact_match_after": score(after[:-1], facts), "general_before": before[-1], "general_after": after[-1],
              "general_kept": GENERAL[1] in after[-1], "examples_after": after[:3], "work_dir": str(args.work_dir) if args.work_dir else None}
    print(json.dumps(result, indent=2))
    if not args.check:
        return 0
    ok = (result["exact_match_before"] <= args.max_before and result["exact_match_after"] >= args.min_after
          and result["general_kept"])
    print("check: " + ("passed" if ok else "FAILED"), file=sys.stderr)
    return 0 if ok else 1
