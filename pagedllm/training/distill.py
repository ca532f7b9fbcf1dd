"""`pagedllm distill`: a corpus of a model's own continuations, to train a draft model on.

A speculative-decoding draft is worth what fraction of its proposals the target accepts, that is
how often it predicts the *target's* next token, not the corpus's. Training the draft on text the
target generated (sequence-level knowledge distillation, as in DistillSpec; Medusa and EAGLE
drafts are trained on their target's generations too) teaches it the target's choices, including
the target's habits that differ from the corpus (its repetitions, its favourite continuations).

How much this raised models/pagedllm-py-draft's acceptance is measured in docs/engine.md (Speculative decoding).

With --chat the prompts are user questions instead (a file of them, or chat_questions.py's
built-in ones) answered through the model's chat template, each written as a {"messages"} record
that `pagedllm finetune` trains on with the loss on the answer only: the data for a chat model's
draft (docs/engine.md, "a trained draft for the default model").

Otherwise the prompts are windows of the training split of a corpus (the same per-document split the
trainer makes, so held-out documents stay held out) at random positions -- any point of a file,
not only function heads -- of random length; the model completes each through the engine
(`LLM.generate`, batched), greedily or, for a fraction of them, sampled. Each prompt and its
continuation make one JSONL record {"text", "source", "temperature"}, which a training job's
`data_config.dataset_path` reads. Deterministic for a given seed, corpus and model; the prompts
of --num-prompts N are the first N of any larger corpus, so --first-prompt extends a corpus or
splits its generation across processes (under CPU contention, OMP_NUM_THREADS=1 per process
keeps the kernels' threads from waiting on each other).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class DistillConfig:
    model: str  # the target model folder (its tokenizer is used throughout)
    dataset_path: str | None  # prompts come from this corpus: a file, folder, JSONL or @stdlib (None with chat)
    out: Path  # JSONL written here
    file_glob: str = "**/*"
    validation_split: float = 0.02  # documents the trainer would hold out at this split are never prompts
    num_prompts: int = 20000
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 256
    max_tokens: int = 192  # continuation length (shorter when the model ends the text)
    sampled_fraction: float = 0.25  # this share of prompts is sampled at `temperature`, the rest greedy
    temperature: float = 0.8
    batch: int = 128  # requests handed to the engine at a time (each batch is written as it completes)
    first_prompt: int = 0  # skip the prompts before this one: extends a corpus, or splits one across processes
    seed: int = 0
    chat: bool = False  # prompts are user questions answered through the chat template (chat_questions.py)
    questions_path: str | None = None  # chat: one question a line instead of the built-in ones


# DistillConfig's fields that are command-line options of their own name and type
_HELP = {
    "validation_split": "documents the trainer would hold out at this split are never prompts",
    "num_prompts": "prompts to continue",
    "min_prompt_tokens": "shortest prompt",
    "max_prompt_tokens": "longest prompt",
    "max_tokens": "continuation length (shorter when the model ends the text)",
    "sampled_fraction": "share of prompts sampled at --temperature, the rest greedy",
    "temperature": "temperature of the sampled prompts",
    "batch": "requests handed to the engine at a time",
    "first_prompt": "skip the prompts before this one (extends a corpus, or splits one across processes)",
    "seed": "prompt choice and sampling seed",
}
_TUNABLES = ("validation_split", "num_prompts", "min_prompt_tokens", "max_prompt_tokens", "max_tokens", "sampled_fraction",
             "temperature", "batch", "first_prompt", "seed")


def training_documents(cfg: DistillConfig, tokenizer) -> list[tuple[str, list[int]]]:
    """(doc_id, token ids) of every training-split document long enough for the shortest prompt."""
    from pagedllm.training.corpus import iter_documents
    from pagedllm.training.data import encode_documents, is_validation

    docs = [d for d in iter_documents(cfg.dataset_path, cfg.file_glob) if not is_validation(d, cfg.validation_split)]
    out = [(doc.doc_id, ids) for doc, ids in encode_documents(docs, tokenizer) if len(ids) > cfg.min_prompt_tokens]
    if not out:
        raise ValueError(f"no training documents of more than {cfg.min_prompt_tokens} tokens in {cfg.dataset_path}")
    return out


def sample_prompts(cfg: DistillConfig, docs: list[tuple[str, list[int]]]) -> list[tuple[str, list[int], float, int]]:
    """(doc_id, prompt ids, temperature, seed): a document drawn in proportion to its length (so every
    token position of the split is equally likely), a length, and a start inside it. Drawn one prompt
    at a time, so the prompts of a smaller --num-prompts are the first ones of a larger."""
    rng = np.random.default_rng(cfg.seed)
    cdf = np.cumsum([len(ids) for _, ids in docs], dtype=np.float64)
    prompts = []
    for i in range(cfg.num_prompts):
        doc_id, ids = docs[min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(docs) - 1)]
        length = int(rng.integers(cfg.min_prompt_tokens, min(cfg.max_prompt_tokens, len(ids)) + 1))
        start = int(rng.integers(0, len(ids) - length + 1))
        sampled = rng.random() < cfg.sampled_fraction
        prompts.append((doc_id, ids[start:start + length], cfg.temperature if sampled else 0.0, cfg.seed * 1_000_003 + i))
    return prompts


def _sampling(cfg: DistillConfig, temperature: float, seed: int):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens, seed=seed if temperature else None)


def _write_records(cfg: DistillConfig, prompts: list, records_of: Callable[[list], Iterable[tuple[dict, int, int]]],
                   unit: str) -> dict:
    """Write cfg.out (a .tmp renamed when complete) from `prompts`, cfg.batch at a time:
    `records_of(group)` yields each prompt's (JSONL record, prompt tokens, generated tokens);
    each batch is flushed as it completes. Returns counts and timings."""
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = cfg.out.with_name(cfg.out.name + ".tmp")
    stats = {"prompts": 0, "prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0}
    began = time.perf_counter()
    with tmp.open("w", encoding="utf-8") as f:
        for first in range(0, len(prompts), cfg.batch):
            group = prompts[first:first + cfg.batch]
            for record, prompt_tokens, generated_tokens in records_of(group):
                f.write(json.dumps(record) + "\n")
                stats["prompt_tokens"] += prompt_tokens
                stats["generated_tokens"] += generated_tokens
            f.flush()
            stats["prompts"] += len(group)
            elapsed = time.perf_counter() - began
            stats["seconds"] = round(elapsed, 1)
            print(f"{stats['prompts']}/{len(prompts)} {unit}, {stats['generated_tokens']} tokens generated, "
                  f"{stats['generated_tokens'] / elapsed:.0f} tok/s", flush=True)
    tmp.replace(cfg.out)
    return stats


def generate_corpus(cfg: DistillConfig, **engine_args) -> dict:
    """Write cfg.out; returns counts and timings."""
    from tokenizers import Tokenizer

    from pagedllm import LLM
    from pagedllm.training.tokenizer import tokenizer_files

    tokenizer = Tokenizer.from_file(str(tokenizer_files(cfg.model)[0]))
    prompts = sample_prompts(cfg, training_documents(cfg, tokenizer))[cfg.first_prompt:]
    llm = LLM(cfg.model, **engine_args)

    def records_of(group):
        params = [_sampling(cfg, t, seed) for _, _, t, seed in group]
        outputs = llm.generate([{"prompt_token_ids": ids} for _, ids, _, _ in group], params, use_tqdm=False)
        for (doc_id, ids, t, _), output in zip(group, outputs):
            generated = list(output.outputs[0].token_ids)
            text = tokenizer.decode(ids + generated, skip_special_tokens=True)
            yield {"text": text, "source": doc_id, "temperature": t}, len(ids), len(generated)

    return _write_records(cfg, prompts, records_of, "prompts")


def chat_prompts(cfg: DistillConfig) -> list[tuple[str, float, int]]:
    """(question, temperature, seed) for each of the first --num-prompts questions (from
    --questions, or chat_questions' own), sampled for a --sampled-fraction share as in corpus mode."""
    from pagedllm.training.chat_questions import questions, read_questions

    found = read_questions(cfg.questions_path) if cfg.questions_path else questions(cfg.num_prompts, cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    return [(q, cfg.temperature if rng.random() < cfg.sampled_fraction else 0.0, cfg.seed * 1_000_003 + i)
            for i, q in enumerate(found[:cfg.num_prompts])]


def generate_chat_corpus(cfg: DistillConfig, **engine_args) -> dict:
    """Write cfg.out with one {"messages": [user, assistant], "temperature"} record a question: the
    model's own answer, in the chat format `pagedllm finetune --data` reads (loss on the answer
    only). Returns counts and timings."""
    from pagedllm import LLM

    prompts = chat_prompts(cfg)[cfg.first_prompt:]
    llm = LLM(cfg.model, **engine_args)

    def records_of(group):
        params = [_sampling(cfg, t, seed) for _, t, seed in group]
        outputs = llm.chat([[{"role": "user", "content": q}] for q, _, _ in group], params, use_tqdm=False)
        for (question, t, _), output in zip(group, outputs):
            answer = output.outputs[0]
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer.text}]
            yield {"messages": messages, "temperature": t}, len(output.prompt_token_ids), len(answer.token_ids)

    return _write_records(cfg, prompts, records_of, "questions")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("distill", help="write a corpus of a model's own continuations (to train a draft model on)")
    d = DistillConfig.__dataclass_fields__
    p.add_argument("--model", required=True, help="the target model: a folder or a GGUF file")
    p.add_argument("--dataset", default=None, help="prompt corpus: text file, folder, JSONL with 'text', or @stdlib")
    p.add_argument("--chat", action="store_true",
                   help="prompts are chat questions (--questions, or built-in ones); writes {'messages': ...} records")
    p.add_argument("--questions", default=None, help="with --chat: a file of questions, one a line")
    p.add_argument("--out", required=True, type=Path, help="JSONL to write")
    p.add_argument("--glob", default=d["file_glob"].default, help="files taken from a dataset folder")
    for name in _TUNABLES:
        default = d[name].default
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=f"{_HELP[name]} (default: {default})")
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="engine KV budget in bytes (default 512 MiB)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.chat == (args.dataset is not None) or (args.questions and not args.chat):
        print("distill: give either --dataset (continuations of a corpus) or --chat [--questions FILE]", file=sys.stderr)
        return 2
    cfg = DistillConfig(model=args.model, dataset_path=args.dataset, out=args.out, file_glob=args.glob, chat=args.chat,
                        questions_path=args.questions, **{name: getattr(args, name) for name in _TUNABLES})
    try:
        generate = generate_chat_corpus if cfg.chat else generate_corpus
        stats = generate(cfg, kv_cache_memory=args.kv_cache_memory)
    except (ValueError, FileNotFoundError) as exc:
        print(f"distill: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.out}: {json.dumps(stats)}")
    return 0
