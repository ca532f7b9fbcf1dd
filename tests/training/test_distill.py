"""`pagedllm distill`: prompts from the training split only, deterministic and prefix-stable; the
corpus it writes is what the trainer reads."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from pagedllm.paths import DRAFT_MODEL
from pagedllm.training.cli import main as training_cli
from pagedllm.training.corpus import iter_documents
from pagedllm.training.data import is_validation
from pagedllm.training.distill import DistillConfig, sample_prompts, training_documents
from pagedllm.training.tokenizer import tokenizer_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import build_model  # noqa: E402


def _config(paths, tmp_path, **extra) -> DistillConfig:
    return DistillConfig(model=str(DRAFT_MODEL), dataset_path=str(paths["corpus"]), out=tmp_path / "out.jsonl",
                         validation_split=0.3, **extra)


def test_prompts_are_windows_of_training_documents(tiny_paths, tmp_path):
    cfg = _config(tiny_paths, tmp_path, num_prompts=200, min_prompt_tokens=8, max_prompt_tokens=40)
    tokenizer = Tokenizer.from_file(str(tokenizer_files(cfg.model)[0]))
    docs = training_documents(cfg, tokenizer)
    held_out = {d.doc_id for d in iter_documents(cfg.dataset_path) if is_validation(d, cfg.validation_split)}
    assert held_out and not held_out & {doc_id for doc_id, _ in docs}
    by_id = dict(docs)
    prompts = sample_prompts(cfg, docs)
    for doc_id, ids, temperature, _ in prompts:
        assert 8 <= len(ids) <= 40 and temperature in (0.0, cfg.temperature)
        source = by_id[doc_id]
        assert any(source[i:i + len(ids)] == ids for i in range(len(source) - len(ids) + 1))
    assert len({doc_id for doc_id, *_ in prompts}) > 1  # not one file over and over
    assert 0 < sum(t > 0 for _, _, t, _ in prompts) < len(prompts)
    assert sample_prompts(cfg, docs) == prompts
    fewer = _config(tiny_paths, tmp_path, num_prompts=50, min_prompt_tokens=8, max_prompt_tokens=40)
    assert sample_prompts(fewer, docs) == prompts[:50]  # a smaller corpus is a prefix of a larger one


def test_cli_writes_jsonl_the_trainer_reads(tiny_paths, tmp_path):
    out = tmp_path / "distill.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pagedllm.training.cli", "distill", "--model", str(DRAFT_MODEL),
                           "--dataset", str(tiny_paths["corpus"]), "--out", str(out), "--num-prompts", "6",
                           "--max-tokens", "8", "--batch", "4", "--sampled-fraction", "0.5",
                           "--kv-cache-memory", str(16 << 20)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6 and all(r["text"] and r["source"] for r in records)
    assert [d.text for d in iter_documents(str(out))] == [r["text"] for r in records]


def test_chat_questions_are_stable_prefixes_and_none_is_a_bench_prompt():
    from pagedllm.bench.chat_prompts import QUESTIONS
    from pagedllm.training.chat_questions import questions

    every = questions(10 ** 6)
    assert len(every) == len(set(every)) > 1500 and questions(40) == every[:40] and questions(40, seed=1) != every[:40]
    assert not set(every) & set(QUESTIONS)  # the bench never measures a draft on its own training text


def test_chat_cli_writes_conversations_the_finetuner_reads(tmp_path, capsys):
    """`distill --chat`: each question and the model's own greedy answer as a {"messages"} record
    that `pagedllm finetune` tokenizes with the loss on the answer; the question file is used as given."""
    from transformers import AutoTokenizer

    from pagedllm import LLM, SamplingParams
    from pagedllm.training.chat_data import read_conversations, tokenize_conversation

    model = build_model(tmp_path / "llama", "llama")
    asked = tmp_path / "questions.txt"
    asked.write_text("What is a cat?\n\nWhy is snow white?\nHow do birds fly?\n")
    out = tmp_path / "chat.jsonl"
    cli = ["distill", "--model", str(model), "--out", str(out), "--max-tokens", "6", "--batch", "2",
           "--sampled-fraction", "0", "--kv-cache-memory", str(16 << 20)]
    assert training_cli([*cli, "--chat", "--questions", str(asked)]) == 0
    conversations = [messages for _, messages in read_conversations(out)]
    assert [m[0]["content"] for m in conversations] == ["What is a cat?", "Why is snow white?", "How do birds fly?"]
    greedy = LLM(str(model), kv_cache_memory=16 << 20).chat([m[:1] for m in conversations],
                                                            SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [m[1]["content"] for m in conversations] == [o.outputs[0].text for o in greedy]
    example = tokenize_conversation(AutoTokenizer.from_pretrained(str(model)), conversations[0])
    assert 0 < sum(example.trained) < len(example.trained)  # trained on the answer only
    for wrong in ([], ["--chat", "--dataset", str(asked)], ["--questions", str(asked), "--dataset", str(asked)]):
        assert training_cli([*cli, *wrong]) == 2 and "either --dataset" in capsys.readouterr().err
