"""Greedy tokens of a batch mixing three adapters and the base model equal transformers + PEFT on
the same adapters, in every engine mode; the prefix cache never serves one adapter's KV to another."""
from __future__ import annotations

import pytest
import torch

from lora_adapters import PEFT_ADAPTERS, make_peft_adapter, peft_greedy
from tiny_models import load_reference

from pagedllm.entrypoints.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

# Two prompts longer than a few blocks of 4, so the prefix cache has whole blocks to (not) share
PROMPTS = [[5, 17, 99, 200, 31, 7, 8, 9, 40, 41, 42, 43, 11], [100, 101, 102, 3, 4, 60, 61, 62, 63, 64]]
NEW_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
LORA = dict(enable_lora=True, lora_dtype="float32")  # float32 pairs: PEFT's tokens exactly (bfloat16: test_lora_dtype.py)
MODES = {
    "prefix_caching": dict(block_size=4),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False),
    "preempt_recompute": dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=32),
    "preempt_swap": dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=32, preemption_mode="swap",
                         swap_space=1 << 20),
}


def peft_tokens(base_model_factory, adapter) -> list[list[int]]:
    return peft_greedy(base_model_factory, adapter, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def references(lora_base, adapters) -> dict[str | None, list[list[int]]]:
    return {name: peft_tokens(lambda: load_reference(lora_base), adapters.get(name))
            for name in (None, "attn", "mlp", "all", "finetuned")}


def requests_for(adapters, names) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index + 1, str(adapters[name])) for index, name in enumerate(names)}


def mixed_batch(llm, loras: dict[str, LoRARequest], names) -> dict[str | None, list[list[int]]]:
    """Every prompt under every adapter in `names` (None: the base), all in one generate call."""
    prompts, chosen = [], []
    for name in names:
        for prompt in PROMPTS:
            prompts.append({"prompt_token_ids": prompt})
            chosen.append(loras[name] if name is not None else None)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=chosen)
    tokens = [o.outputs[0].token_ids for o in outputs]
    return {name: tokens[i * len(PROMPTS):(i + 1) * len(PROMPTS)] for i, name in enumerate(names)}


def test_adapters_change_the_reference(references):
    """Otherwise every comparison below could pass with the adapters ignored."""
    for name in ("attn", "mlp", "all", "finetuned"):
        assert references[name] != references[None], name


@pytest.mark.parametrize("mode", MODES)
def test_mixed_batch_equals_peft(lora_base, adapters, references, mode):
    names = ("attn", "mlp", "finetuned")
    loras = requests_for(adapters, names)
    llm = LLM(str(lora_base), **LORA, max_loras=3, max_lora_rank=8, **MODES[mode])
    # the base first: with prefix caching its blocks are cached when the adapters' same prompts come
    assert mixed_batch(llm, loras, (None,))[None] == references[None]
    got = mixed_batch(llm, loras, (None, *names))
    assert got == {name: references[name] for name in (None, *names)}
    if mode == "preempt_recompute" or mode == "preempt_swap":
        assert llm.get_stats()["num_preemptions"] > 0, "the mode did not preempt"


def test_more_adapters_than_slots_take_turns(lora_base, adapters, references):
    """Four adapters, two slots, one host copy: every step holds at most two adapters, the others
    wait, and evicted ones are read from their folders again; tokens stay PEFT's."""
    names = ("attn", "mlp", "all", "finetuned")
    loras = requests_for(adapters, names)
    llm = LLM(str(lora_base), **LORA, max_loras=2, max_cpu_loras=2, max_lora_rank=8, block_size=4)
    got = mixed_batch(llm, loras, (*names, None))
    assert got == {name: references[name] for name in (*names, None)}
    manager = llm.llm_engine.runner.lora
    assert len(manager.resident) <= 2 and len(manager.host) <= 2
    assert manager.loads > len(names), "no adapter was loaded again after eviction"


def test_gguf_base_with_fp32_adapters(gguf_base, adapters, tmp_path):
    """The kept 4-bit base (Q4_1 blocks through the C kernels) with adapters; the reference is
    transformers' dequantized GGUF + PEFT."""
    from transformers import AutoModelForCausalLM

    path, _hf = gguf_base
    factory = lambda: AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,  # noqa: E731
                                                           dtype=torch.float32).eval()
    names = ("attn", "mlp")
    expected = {name: peft_tokens(factory, adapters.get(name)) for name in (None, *names)}
    assert expected["mlp"] != expected[None]
    loras = requests_for(adapters, names)
    llm = LLM(str(path), **LORA, max_loras=2, max_lora_rank=8, block_size=4, int8_activations=False,
              kv_cache_memory=16 << 20)
    assert mixed_batch(llm, loras, (None, *names)) == expected


def test_the_fused_decode_step_adds_the_deltas(lora_base, adapters, references, monkeypatch):
    """Decode steps with adapter rows run as one fused C call (csrc/decode_step.c adds the
    deltas, gate/up's before the SiLU) — the same tokens as PEFT; the modules are not asked."""
    from pagedllm.models.fused_decode import FusedDecoder

    calls = {"lora": 0, "base": 0}
    original = FusedDecoder.__call__

    def counting(self, *args, **kwargs):
        calls["lora" if (len(args) > 4 and args[4] is not None) else "base"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FusedDecoder, "__call__", counting)
    names = ("attn", "mlp", "all", "finetuned")
    llm = LLM(str(lora_base), **LORA, max_loras=4, max_lora_rank=8, block_size=4, decode_backend="fused")
    got = mixed_batch(llm, requests_for(adapters, names), (None, *names))
    assert got == {name: references[name] for name in (None, *names)}
    assert calls["lora"] >= NEW_TOKENS - 1, calls


def test_samples_and_structured_output_with_an_adapter(lora_base, adapters, references):
    """n > 1 forks share the adapter (greedy samples all equal PEFT's tokens); a grammar-constrained
    request with an adapter keeps to its grammar."""
    from pagedllm.sampling_params import StructuredOutputsParams

    loras = requests_for(adapters, ("mlp",))
    llm = LLM(str(lora_base), **LORA, max_lora_rank=8, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False, lora_request=loras["mlp"])
    assert [c.token_ids for c in out.outputs] == [references["mlp"][0]] * 2
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,) = llm.generate(["Answer:"], choice, use_tqdm=False, lora_request=loras["mlp"])
    assert out.outputs[0].text in ("yes", "no")


def test_the_triton_path_with_adapters(lora_base, adapters, references):
    """The Triton path (attention, RMSNorm, rotary and SiLU-up kernels, here through Triton's
    interpreter): adapter rows get their deltas from the projections around the kernels (no CUDA
    graph replays a step with adapter rows); tokens stay PEFT's."""
    lora = requests_for(adapters, ("mlp",))["mlp"]
    llm = LLM(str(lora_base), **LORA, max_lora_rank=8, block_size=4, attention_backend="triton")
    llm.llm_engine.runner.model.use_triton_ops()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # (the interpreter is slow: a greedy prefix)
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * 2, params, use_tqdm=False, lora_request=[None, lora])
    assert references[None][1][:3] != references["mlp"][1][:3]  # (the prefix compared tells them apart)
    assert [o.outputs[0].token_ids for o in outputs] == [references[None][1][:3], references["mlp"][1][:3]]


def test_the_fused_step_folds_every_site_of_a_wide_model(tmp_path):
    """The fused step's folded sites where the tiny base does not reach them: an intermediate size
    over 256 (the down projection's shrink summed from several silu items' partials, the last one
    short) with 8 query heads over 2 KV heads (o's shrink from per-KV-head partials), and an adapter
    on o and down only, alone in its steps (no raw gate/up panels: the down deltas' own stage).
    Each against transformers + PEFT."""
    from tiny_models import build_model

    from lora_adapters import make_peft_adapter

    base = build_model(tmp_path / "wide", "llama", intermediate_size=640, num_attention_heads=8, num_key_value_heads=2)
    adapters = {"all": make_peft_adapter(base, tmp_path / "all", 4, 8, PEFT_ADAPTERS["all"][2], seed=3),
                "o_down": make_peft_adapter(base, tmp_path / "o_down", 4, 8, ["o_proj", "down_proj"], seed=4)}
    expected = {name: peft_tokens(lambda: load_reference(base), adapters.get(name)) for name in (None, "all", "o_down")}
    assert expected["all"] != expected[None] and expected["o_down"] != expected[None]
    llm = LLM(str(base), **LORA, max_loras=2, max_lora_rank=8, block_size=4, decode_backend="fused")
    loras = requests_for(adapters, ("all", "o_down"))
    assert mixed_batch(llm, loras, (None, "all")) == {name: expected[name] for name in (None, "all")}
    assert mixed_batch(llm, loras, ("o_down",)) == {"o_down": expected["o_down"]}


def test_the_fused_step_with_an_adapter_on_some_projections_beside_others(lora_base, adapters, references, tmp_path):
    """One adapter on up and k only (no gate pair beside an up pair, no q/v beside a k pair) in the
    fused step's rows together with an adapter on all seven and base rows: each row gets exactly
    its own adapter's deltas, against transformers + PEFT."""
    some = make_peft_adapter(lora_base, tmp_path / "up_k", 4, 8, ["up_proj", "k_proj"], seed=11)
    expected = peft_tokens(lambda: load_reference(lora_base), some)
    assert expected != references[None]
    llm = LLM(str(lora_base), **LORA, max_loras=2, max_lora_rank=8, block_size=4, decode_backend="fused")
    loras = requests_for({"all": adapters["all"], "up_k": some}, ("all", "up_k"))
    got = mixed_batch(llm, loras, ("up_k", None, "all"))
    assert got == {"up_k": expected, None: references[None], "all": references["all"]}
