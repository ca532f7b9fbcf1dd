"""What bfloat16 LoRA pairs (EngineConfig.lora_dtype) cost in quality, on the default model.

For `bench lora`'s random rank-8 adapters on all seven projections (and the same adapters with
a B `--strong` times larger, deltas that move most answers), over chat prompts, each request on
adapter i % 4:
  - greedy tokens: transformers + PEFT in float32 (the reference, on the GGUF's dequantized
    weights), our engine with float32 pairs and with bfloat16 pairs, on those dense weights and
    on the GGUF's kept 4-bit blocks (int8 activations off): how many sequences diverge from the
    reference, and from the float32 pairs, and at which token;
  - logits: transformers + PEFT with the adapter as saved, against the same adapter with A and B
    rounded to bfloat16 (what the engine's bfloat16 pairs hold; the scaling is 2, a power of
    two, so rounding B is rounding B * scaling), teacher-forced over the reference's sequences:
    the largest |logit difference| at any position, next to the largest the adapter itself makes
    against the base (the size of the delta the rounding perturbs).

    .venv/bin/python scripts/lora_dtype_quality.py [--new-tokens 64] [--strong 10]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "List three prime numbers greater than 50.", "How do I boil an egg?", "What is a linked list?",
    "Translate 'good morning' into Spanish.", "Give me a tip for learning to code.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "What does a CPU cache do?", "Name two planets with rings.",
    "Write a short thank-you note to a teacher.", "What is 17 times 23?", "Describe a cat in three sentences.",
    "What causes the seasons on Earth?",
]


def reference(folder: Path, adapter: Path | None, rounded: bool = False):
    """transformers' float32 model of `folder`, with the PEFT adapter (its A and B rounded to
    bfloat16 when `rounded`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if adapter is None:
        return model
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    if rounded:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def divergence(tokens: list[list[int]], expected: list[list[int]]) -> list[int | None]:
    """Per sequence, the index of the first token that differs from the reference (None: none)."""
    return [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None) for got, want in zip(tokens, expected)]


def measure(model: Path, folder: Path, paths: list[Path], prompts: list[list[int]], new_tokens: int) -> None:
    from pagedllm import LLM, LoRARequest, SamplingParams

    count = len(paths)
    expected: list[list[int]] = [[] for _ in prompts]
    worst, adapter_effect = 0.0, 0.0
    base = reference(folder, None)
    for a, adapter in enumerate(paths):
        exact, rounded = reference(folder, adapter), reference(folder, adapter, rounded=True)
        for index in range(a, len(prompts), count):  # the prompts of adapter a
            prompt = prompts[index]
            with torch.no_grad():
                ids = exact.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False)
                expected[index] = ids[0, len(prompt):].tolist()
                logits = exact(ids).logits[0, len(prompt) - 1:]
                worst = max(worst, (logits - rounded(ids).logits[0, len(prompt) - 1:]).abs().max().item())
                adapter_effect = max(adapter_effect, (logits - base(ids).logits[0, len(prompt) - 1:]).abs().max().item())
    print(f"  logits, PEFT float32 vs pairs rounded to bfloat16: max |diff| {worst:.4f} "
          f"(the adapter against the base: max |diff| {adapter_effect:.2f})", flush=True)
    # min_tokens: EOS masked as transformers' min_new_tokens masks it (with ignore_eos, as in vLLM,
    # EOS stays a candidate: ours would pick it where transformers takes the runner-up)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    for weights, label in ((folder, "dense float32 base (PEFT's weights)"), (model, "GGUF base (Q4_1 kept)")):
        for lora_dtype in ("float32", "bfloat16"):
            llm = LLM(str(weights), enable_lora=True, max_loras=count, max_lora_rank=8, lora_dtype=lora_dtype,
                      int8_activations=False if weights == model else None, enable_prefix_caching=False)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                   lora_request=[loras[i % count] for i in range(len(prompts))])
            llm.llm_engine.shutdown()
            tokens[label, lora_dtype] = [o.outputs[0].token_ids for o in outputs]
        for got, against, name in (("float32", expected, "PEFT"), ("bfloat16", expected, "PEFT"),
                                   ("bfloat16", tokens[label, "float32"], "float32 pairs")):
            where = [w for w in divergence(tokens[label, got], against) if w is not None]
            print(f"  pagedllm, {label}, {got} pairs: {len(where)} of {len(prompts)} sequences diverge from {name}'s "
                  f"greedy tokens{' (at token ' + ', '.join(map(str, where)) + ')' if where else ''}", flush=True)


def main() -> None:
    from transformers import AutoTokenizer

    from pagedllm.bench.dequantized import dequantized_folder
    from pagedllm.bench.lora import write_adapters
    from pagedllm.config import ModelConfig
    from pagedllm.paths import default_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--strong", type=float, default=10.0, help="the second set's B, times the bench's")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: no spinning on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = default_model()
    folder = dequantized_folder(model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    config = ModelConfig.from_pretrained(str(model))
    with tempfile.TemporaryDirectory(prefix="pagedllm-lora-quality-") as tmp:
        for label, b_std in (("bench adapters (B std 0.01)", 0.01), (f"strong adapters (B std {0.01 * args.strong:g})",
                                                                     0.01 * args.strong)):
            paths = write_adapters(config, 4, 8, Path(tmp) / label.split()[0], b_std=b_std)
            print(f"{model.name}, {len(prompts)} chat prompts, {args.new_tokens} greedy tokens, {label}:", flush=True)
            measure(model, folder, paths, prompts, args.new_tokens)


if __name__ == "__main__":
    main()
