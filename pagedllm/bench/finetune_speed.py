"""Fine-tuning speed against transformers `Trainer` (+ PEFT for LoRA): `pagedllm bench finetune --against transformers`.

Both sides train the same base (the GGUF dequantized to float32: ours through pagedllm/gguf,
theirs through transformers' `from_pretrained(..., gguf_file=...)`) on the same examples — a
generated chat dataset whose answers run from one sentence to a dozen, tokenized once by
training/chat_data.py so both see the same ids and the same assistant-only labels — with the same
optimizer (AdamW, no weight decay), learning rate, rows per step, micro batch and LoRA settings
(rank, alpha, no dropout, all seven projections). What differs is what each does by default with
a batch: we pack examples into rows of `--max-seq-len` (segment ids keep them apart); `Trainer`
with `DataCollatorForSeq2Seq` pads each batch to its longest example. Throughput is therefore
counted in **example tokens per second** (the tokens of the examples a step trains on, padding
excluded), after the first step (warm-up), each side in its own process (peak RSS from
`getrusage`), the sides taking turns for `--rounds` rounds; the best round of each is reported.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pagedllm.bench.invented_facts import invented_facts
from pagedllm.bench.scratch import scratch_dir

SIDES = ("pagedllm", "transformers")


def write_varied_dataset(path: Path, count: int, seed: int) -> Path:
    """Chat examples of varied length: each answer states 1 to 12 invented facts."""
    facts = invented_facts(12 * 8, seed)
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        chosen = rng.sample(facts, 1 + i % 12)
        question = "Where were these people born: " + ", ".join(p for p, _ in chosen) + "?"
        answer = " ".join(f"{p} was born in {t}." for p, t in chosen)
        lines.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _examples(model: str, data: Path, seq_len: int):
    from pagedllm.training.chat_data import read_conversations, tokenize_examples
    from pagedllm.training.pretrained import base_tokenizer

    tokenizer = base_tokenizer(model)
    return tokenizer, tokenize_examples(tokenizer, read_conversations(data), str(data), seq_len)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- one side, in its own process ----------------------------------------------------------------
def run_ours(spec: dict) -> dict:
    """`pagedllm finetune` for `steps` steps; step times from its metrics.jsonl."""
    from pagedllm.training.chat_data import PackedRows
    from pagedllm.training.cli import main as training_cli

    tokenizer, examples = _examples(spec["model"], Path(spec["data"]), spec["seq_len"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = PackedRows(examples, spec["seq_len"], pad)
    tokens_per_row = int((rows.segments != -1).sum()) / rows.num_sequences  # the packing's fill
    out = Path(spec["work"]) / f"ours-{spec['method']}-{spec['round']}"
    shutil.rmtree(out, ignore_errors=True)  # the bench's own folder: a fresh run each time
    argv = ["finetune", "--model", spec["model"], "--data", spec["data"], "--method", spec["method"], "--out", str(out),
            "--steps", str(spec["steps"]), "--learning-rate", str(spec["learning_rate"]), "--lora-rank", str(spec["rank"]),
            "--lora-alpha", str(2 * spec["rank"]), "--max-seq-len", str(spec["seq_len"]), "--batch-size", str(spec["batch"]),
            "--micro-batch-size", str(spec["micro_batch"]), "--peak-flops", "1e12"]
    if training_cli(argv) != 0:
        raise SystemExit("the fine-tune failed")
    records = [json.loads(line) for line in (out / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    per_step = spec["batch"] * spec["seq_len"]
    seconds = sum(per_step / r["tokens_per_s"] for r in records[1:])
    return {"example_tokens_per_s": tokens_per_row * spec["batch"] * (len(records) - 1) / seconds,
            "row_fill": tokens_per_row / spec["seq_len"], "seconds_per_step": seconds / (len(records) - 1)}


def run_transformers(spec: dict) -> dict:
    """transformers `Trainer` (+ PEFT's LoRA) on the same examples, padded per batch."""
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    from pagedllm.training.chat_data import IGNORE

    tokenizer, examples = _examples(spec["model"], Path(spec["data"]), spec["seq_len"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = []
    for ex in examples:
        ids = ex.ids[:spec["seq_len"]]  # the positions our packed rows compute for it
        rows.append({"input_ids": ids, "labels": [tok if keep else IGNORE for tok, keep in zip(ids, ex.trained[:len(ids)])]})
    model = AutoModelForCausalLM.from_pretrained(spec["hf_base"], dtype=torch.float32)
    if spec["method"] != "full":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"], lora_dropout=0.0,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE)
    counted: list[int] = []

    def collate(batch):
        out = collator(batch)
        counted.append(int(out["attention_mask"].sum()))
        return out

    marks: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    args = TrainingArguments(output_dir=str(Path(spec["work"]) / f"hf-{spec['method']}-{spec['round']}"), max_steps=spec["steps"],
                             per_device_train_batch_size=spec["micro_batch"],
                             gradient_accumulation_steps=spec["batch"] // spec["micro_batch"],
                             learning_rate=spec["learning_rate"], weight_decay=0.0, lr_scheduler_type="constant",
                             logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[StepTimes()]).train()
    micro_per_step = spec["batch"] // spec["micro_batch"]
    tokens_after_first = sum(counted[micro_per_step:micro_per_step * spec["steps"]])
    seconds = marks[-1] - marks[0]
    return {"example_tokens_per_s": tokens_after_first / seconds, "seconds_per_step": seconds / (len(marks) - 1)}


def convert_base(spec: dict) -> dict:
    """The base as a plain float32 Hugging Face folder for the transformers side: transformers marks
    a model read with `gguf_file=` as quantized and its Trainer refuses to train it, although the
    weights are dequantized; a user saves it once with `save_pretrained`, as this does."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.training.pretrained import base_model_path

    path = base_model_path(spec["model"])
    if path.suffix != ".gguf":
        return {"hf_base": str(path)}
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)  # the weights are float32: a plain checkpoint
    model.save_pretrained(spec["hf_base"])
    return {"hf_base": spec["hf_base"]}


def child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    side = {"pagedllm": run_ours, "transformers": run_transformers, "convert": convert_base}[spec["side"]]
    result = side(spec)
    result["peak_rss_mib"] = round(_peak_rss_mib())
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# ---- the comparison --------------------------------------------------------------------------------
def _one(spec: dict, work: Path) -> dict:
    spec_path = work / f"spec-{spec['side']}-{spec['method']}-{spec['round']}.json"
    spec["result"] = str(spec_path.with_suffix(".result.json"))
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "pagedllm.bench.finetune_speed", str(spec_path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench finetune ({spec['side']}, {spec['method']}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(spec["result"]).read_text())


def run(args: argparse.Namespace) -> int:
    with scratch_dir("pagedllm-bench-finetune-speed-", args.work_dir) as work:
        return _compare(args, work)


def _compare(args: argparse.Namespace, work: Path) -> int:
    data = write_varied_dataset(work / "varied.jsonl", args.examples, args.seed)
    methods = ["lora", "full"] if args.method == "both" else [args.method]
    hf_base = _one({"side": "convert", "method": "-", "round": 0, "model": args.model,
                    "hf_base": str(work / "hf-base")}, work)["hf_base"]
    report: dict = {"model": args.model, "examples": args.examples, "steps": args.steps, "batch": args.batch_size,
                    "micro_batch": min(4, args.batch_size), "seq_len": args.max_seq_len, "rounds": args.rounds, "results": {}}
    for method in methods:
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for round_ in range(args.rounds):
            for side in SIDES:  # taking turns
                spec = {"side": side, "method": method, "round": round_, "model": args.model, "data": str(data),
                        "work": str(work), "steps": args.steps, "seq_len": args.max_seq_len, "batch": args.batch_size,
                        "micro_batch": min(4, args.batch_size), "rank": args.lora_rank,
                        "learning_rate": 2e-5 if method == "full" else 2e-4, "hf_base": hf_base}
                runs[side].append(_one(spec, work))
                print(f"{method} round {round_ + 1} {side}: {runs[side][-1]}", file=sys.stderr)
        best = {side: max(r["example_tokens_per_s"] for r in runs[side]) for side in SIDES}
        report["results"][method] = {
            "pagedllm_tokens_per_s": round(best["pagedllm"], 1), "transformers_tokens_per_s": round(best["transformers"], 1),
            "speedup": round(best["pagedllm"] / best["transformers"], 2),
            "pagedllm_peak_rss_mib": max(r["peak_rss_mib"] for r in runs["pagedllm"]),
            "transformers_peak_rss_mib": max(r["peak_rss_mib"] for r in runs["transformers"]),
            "pagedllm_row_fill": round(runs["pagedllm"][0]["row_fill"], 3), "runs": runs}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1]))
