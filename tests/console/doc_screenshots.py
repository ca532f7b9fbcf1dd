"""Writes the screenshots in docs/ (console-chat.png, console-training.png) from a real session:
the default model served, a completion streamed in the playground, and a small training job on the
standard library's json package with the default model's tokenizer (copied under the server's
data dir, where jobs may read), watched until it completes.

    .venv/bin/python tests/console/doc_screenshots.py        # from the repository root (paths are relative to it)
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from console.browser import Browser  # noqa: E402
from console.server import ConsoleServer  # noqa: E402
from jobs.helpers import to_toml  # noqa: E402

JOB = {
    "job_name": "json-tiny",
    "seed": 0,
    "log_interval_steps": 10,
    "model_config": {"num_layers": 2, "hidden_size": 96, "num_attention_heads": 4, "num_kv_heads": 4,
                     "intermediate_size": 256, "vocab_size": 8192, "max_position_embeddings": 256,
                     "tie_word_embeddings": True},
    "optimization_config": {"learning_rate": 0.003, "warmup_steps": 10, "total_steps": 150},
    "memory_config": {"zero_stage": 0},
    "data_config": {"dataset_path": "@stdlib", "file_glob": "json/*.py", "tokenizer_path": "tokenizers/pagedllm-py-tiny",
                    "sequence_length": 128, "global_batch_size": 8, "micro_batch_size": 8,
                    "validation_split": 0.1, "eval_interval_steps": 25, "eval_sequences": 32},
    "checkpoint_config": {"checkpoint_interval_steps": 50},
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # the default model's tokenizer, where a job may read it: under the server's data dir
        tokenizer = Path(tmp) / "data" / "tokenizers" / "pagedllm-py-tiny"
        tokenizer.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(ROOT / "models/pagedllm-py-tiny" / name, tokenizer / name)
        server = ConsoleServer.start(["--model", str(ROOT / "models/pagedllm-py-tiny"), "--kv-cache-memory", "268435456",
                                      "--train-slots", "1"], Path(tmp))
        try:
            with Browser() as browser:
                tab = browser.new_page(server.url)
                p = tab.page
                p.wait_for_function("document.querySelector('#chat-model').value !== ''")
                server.http.post("/v1/completions", json={"prompt": "import os", "max_tokens": 8})  # warm-up
                p.select_option("#chat-mode", "completion")
                p.fill("#s-temperature", "0.2")
                p.fill("#s-seed", "1")
                p.fill("#s-max_tokens", "96")
                p.fill("#chat-text", "import os\n\n\ndef list_python_files(folder):")
                p.press("#chat-text", "Enter")
                p.wait_for_selector(".message.assistant:not(.streaming) .meta:has-text('finish')")
                p.screenshot(path=ROOT / "docs/console-chat.png")

                p.click("#tabs a[data-tab='jobs']")
                p.click("[data-submit='paste']")
                p.fill("#job-text", to_toml(JOB))
                p.click("#job-paste button[type='submit']")
                p.wait_for_selector("#job-detail h2 .badge:has-text('COMPLETED')", timeout=600_000)
                p.wait_for_timeout(1500)
                p.screenshot(path=ROOT / "docs/console-training.png")
                tab.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
