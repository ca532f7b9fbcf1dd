"""`pagedllm tokenizer train`: a byte-level BPE that transformers' AutoTokenizer loads with its special tokens."""
from __future__ import annotations

import json
import subprocess
import sys

from .helpers import write_corpus


def test_tokenizer_train_cli_writes_a_loadable_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "tok"
    proc = subprocess.run([sys.executable, "-m", "pagedllm.training.cli", "tokenizer", "train", "--input", str(corpus),
                           "--vocab-size", "320", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "chat_template" in config
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert len(tok) == 320
    code = "def f(x):\n    return x  # ünïcode\n"
    assert tok.decode(tok(code)["input_ids"]) == code  # byte-level: whitespace and any character survive
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_tokenizer_train_rejects_tiny_vocab_and_empty_input(tmp_path):
    for argv in (["--input", str(tmp_path), "--vocab-size", "100"], ["--input", str(tmp_path), "--vocab-size", "300"]):
        proc = subprocess.run([sys.executable, "-m", "pagedllm.training.cli", "tokenizer", "train", *argv,
                               "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and ("--vocab-size" in proc.stderr or "--input" in proc.stderr)
