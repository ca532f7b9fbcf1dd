"""A draft model cut from the target itself: its embeddings, tied LM head, final norm and a few of
its layers (by default the first two), saved as a plain float32 folder next to the target's
tokenizer, with a `draft_vocab.json` ranking from the target's own greedy chat answers.

Why: a draft must share the target's vocabulary, and the cheapest draft that already "knows"
the target's token statistics is the target with most of its layers skipped (early exit /
self-speculation, as in LayerSkip and Draft & Verify). It needs no training, so it can be built
in a minute from the installed GGUF; `pagedllm distill` + `pagedllm finetune` can then train it
on the target's own continuations. The ranking lets it score only the few thousand tokens chat
answers use (`draft_vocab_size`), since the 49,152 x 576 head is most of a pass's reads.

    python -m pagedllm.spec_decode.layer_draft --model <SmolLM2 GGUF> --out build/smollm2-draft --layers 0,1
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pagedllm.spec_decode import draft_vocab

# Questions whose greedy answers rank the draft's vocabulary: none is among the bench's
# (bench/chat_prompts.py), so `bench spec` does not measure on the ranking's own text.
RANKING_QUESTIONS = (
    "What is a good way to learn a new language?", "Explain how rain forms.", "Write a haiku about autumn.",
    "What are the planets of the solar system?", "How do I make a cup of tea?", "Why do cats purr?",
    "Give me advice for a job interview.", "What is gravity?", "Describe the city of Rome.",
    "How do I change a flat tire?", "What is the internet?", "List five fruits rich in vitamin C.",
    "How does the heart pump blood?", "Write a thank-you note to a teacher.", "What is democracy?",
    "How can I save money on groceries?", "Explain what an atom is.", "What makes a good friend?",
    "How do bees make honey?", "What is the history of the bicycle?", "How do I write a cover letter?",
    "What is electricity?", "Suggest a weekend activity for a family.", "Why is recycling important?",
)


def build(model: str | Path, out: str | Path, layers: list[int], answer_tokens: int = 160,
          questions: tuple[str, ...] = RANKING_QUESTIONS) -> Path:
    """Write the draft folder `out` from target `model` (a GGUF file) keeping `layers` (renumbered
    0.. in that order), its vocabulary ranked by the target's answers to `questions`; returns `out`."""
    from safetensors.torch import save_file

    from pagedllm.gguf.config import hf_config
    from pagedllm.gguf.file import open_gguf
    from pagedllm.gguf.tokenizer import gguf_tokenizer
    from pagedllm.gguf.weights import tensors

    gguf = open_gguf(model)
    config = hf_config(gguf)
    if not layers or any(not 0 <= i < config["num_hidden_layers"] for i in layers):
        raise ValueError(f"layers {layers} must be indices of the target's {config['num_hidden_layers']} layers")
    renumber = {i: new for new, i in enumerate(layers)}

    def skip(key: str) -> bool:
        return key.startswith("model.layers.") and int(key.split(".")[2]) not in renumber

    state = {}
    for key, value in tensors(gguf, skip=skip):
        if key.startswith("model.layers."):
            parts = key.split(".")
            parts[2] = str(renumber[int(parts[2])])
            key = ".".join(parts)
        state[key] = value.contiguous()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    draft_config = {**config, "num_hidden_layers": len(layers), "torch_dtype": "float32",
                    "pagedllm_draft": {"from": Path(model).name, "layers": layers}}
    (out / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
    gguf_tokenizer(gguf).save_pretrained(str(out))
    _write_ranking(model, out, config["vocab_size"], answer_tokens, questions)
    return out


def _write_ranking(model: str | Path, out: Path, vocab_size: int, answer_tokens: int, questions: tuple[str, ...]) -> None:
    """draft_vocab.json: every token id, most frequent first in the target's greedy answers to
    `questions` (prompts and answers), what a chat draft will be asked to propose."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model), kv_cache_memory=64 << 20)
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=answer_tokens), use_tqdm=False)
    tokens = np.array([t for o in outputs for t in list(o.prompt_token_ids) + list(o.outputs[0].token_ids)])
    draft_vocab.write(out, draft_vocab.rank_tokens(tokens, vocab_size), len(tokens))


def main(argv: list[str] | None = None) -> int:
    from pagedllm.paths import default_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="target GGUF (default: the default model)")
    parser.add_argument("--out", type=Path, required=True, help="draft folder to write")
    parser.add_argument("--layers", default="0,1", help="the target's layers kept, comma-separated (default: %(default)s)")
    parser.add_argument("--answer-tokens", type=int, default=160, help="tokens per ranking answer (default: %(default)s)")
    args = parser.parse_args(argv)
    out = build(args.model or default_model(), args.out, [int(i) for i in args.layers.split(",")], args.answer_tokens)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
