"""The fine-tuning learning check, small (issue 40 item 5): `pagedllm bench finetune --check` with four
invented facts. LoRA on SmolLM2-135M-Instruct (the default GGUF) must answer held-out paraphrases of
what it was taught (it knew none before), through the engine serving the merged model, and still
answer a general question. The full-size check (20 facts, 60 steps) is `pagedllm bench finetune
--check`; its last result is in docs/benchmarks.md."""
from __future__ import annotations

import argparse
import json

from pagedllm.bench import finetune


def test_lora_learns_invented_facts_and_keeps_what_it_knew(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    finetune.add_arguments(parser)
    args = parser.parse_args(["--check", "--facts", "4", "--steps", "12", "--batch-size", "4", "--max-seq-len", "128",
                              "--learning-rate", "2e-3", "--work-dir", str(tmp_path)])
    code = finetune.run(args)
    out = capsys.readouterr().out  # the trainer's step lines, then the bench's JSON
    result = json.loads(out[out.rindex('{\n  "model"'):])
    assert result["exact_match_before"] == 0.0
    assert result["exact_match_after"] >= 0.9, result["examples_after"]
    assert result["general_kept"], result["general_after"]
    assert code == 0
