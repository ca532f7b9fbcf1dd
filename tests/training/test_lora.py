"""LoRA in PEFT's format, both ways: our adapter loaded by peft.PeftModel.from_pretrained on the
transformers model gives our logits, and an adapter PEFT made loads into ours with the same logits.
QLoRA: the model whose base stays in blocks gives the dequantized model's logits and gradients."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.adapters.peft_format import AdapterFormatError, load_adapter
from pagedllm.training.config import FinetuneConfig, parse_job, resolve
from pagedllm.training.pretrained import apply_base_model
from pagedllm.training.finetune import build_finetune_model, model_with_adapter, write_adapter
from pagedllm.training.lora import adapter_state, merged_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_files import write_gguf  # noqa: E402
from tiny_models import build_model, load_reference  # noqa: E402

IDS = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(1))


def shape(base: Path):
    job = parse_job({"finetune_config": {"base_model": str(base)}, "memory_config": {"zero_stage": 0},
                     "data_config": {"dataset_path": "x.jsonl", "sequence_length": 16, "global_batch_size": 1, "micro_batch_size": 1}})
    return resolve(apply_base_model(job), 1).model


def randomize_adapters(model: torch.nn.Module, seed: int = 3) -> None:
    """B starts at zero (a no-op adapter); random B makes the comparison mean something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("lora") / "qwen2", "qwen2", tie_word_embeddings=True)


def test_our_adapter_loads_into_peft_with_our_logits(folder, tmp_path):
    from peft import PeftModel

    ft = FinetuneConfig(base_model=str(folder), method="lora", lora_rank=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    ours = build_finetune_model(shape(folder), ft).eval()
    with torch.no_grad():
        before = ours(IDS)
    randomize_adapters(ours)
    out = write_adapter(adapter_state(ours), ft, tmp_path / "adapter")
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    peft_model = PeftModel.from_pretrained(load_reference(folder), str(out)).eval()
    with torch.no_grad():
        mine, theirs = ours(IDS), peft_model(IDS).logits
    assert not torch.allclose(mine, before, atol=1e-3)  # the adapter changes the output
    torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)


def test_a_peft_adapter_loads_into_ours_with_its_logits(folder, tmp_path):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
                        init_lora_weights=False, task_type="CAUSAL_LM")  # random B: not a no-op
    peft_model = get_peft_model(load_reference(folder), config).eval()
    peft_model.save_pretrained(str(tmp_path / "peft"))
    ours = model_with_adapter(shape(folder), str(folder), tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), peft_model(IDS).logits, atol=2e-5, rtol=1e-4)
        merged = peft_model.merge_and_unload().state_dict()
    for name, tensor in merged_state(ours).items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-5, rtol=1e-4)


def test_unsupported_adapter_fields_are_named(folder, tmp_path):
    from peft import LoraConfig, get_peft_model

    get_peft_model(load_reference(folder), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)).save_pretrained(str(tmp_path / "d"))
    with pytest.raises(AdapterFormatError, match="use_dora"):
        load_adapter(tmp_path / "d")
    with pytest.raises(AdapterFormatError, match="adapter_config.json"):
        load_adapter(tmp_path)


def test_only_the_adapter_trains(folder):
    ft = FinetuneConfig(base_model=str(folder), method="lora", lora_rank=2)
    model = build_finetune_model(shape(folder), ft)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".adapter.lora_" in n for n in trained)
    assert len(trained) == 2 * 7 * 2  # A and B, seven projections, two layers


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    hf = build_model(root / "hf", "llama", hidden_size=64, intermediate_size=128)
    return lambda arch, weight_type: write_gguf(hf, root / f"{weight_type}.gguf", arch, weight_type)


@pytest.mark.parametrize("weight_type", ["Q4_1", "Q8_0"])
def test_qlora_forward_and_backward_equal_the_dequantized_model(tiny_gguf, weight_type):
    """QLoRA (base kept as the GGUF's blocks) vs LoRA on the same file's dequantized weights: same
    logits, same adapter gradients; and the adapted layers hold no float weight."""
    path = tiny_gguf("llama", weight_type)
    cfg = shape(path)
    torch.manual_seed(0)
    qlora = build_finetune_model(cfg, FinetuneConfig(base_model=str(path), method="qlora", lora_rank=4))
    torch.manual_seed(0)
    lora = build_finetune_model(cfg, FinetuneConfig(base_model=str(path), method="lora", lora_rank=4))
    randomize_adapters(qlora)
    randomize_adapters(lora)
    assert not any(n.endswith("q_proj.weight") for n, _ in qlora.named_parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out_q, out_l = qlora(ids), lora(ids)
    torch.testing.assert_close(out_q, out_l, atol=1e-5, rtol=1e-4)
    out_q.square().mean().backward()
    out_l.square().mean().backward()
    grads_l = {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}
    for name, p in qlora.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads_l[name], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_lora_linear_equals_the_modules_in_value_and_gradients(bias):
    """LoraLinearFn (one autograd function, update accumulated by the GEMM) against F.linear + the pair's modules."""
    from pagedllm.adapters.peft_format import LoraSettings
    from pagedllm.training.lora import LoraLinear

    torch.manual_seed(0)
    layer = LoraLinear(torch.nn.Linear(24, 40, bias=bias), LoraSettings(4, 8.0, 0.0, ("q_proj",))).double()
    torch.nn.init.normal_(layer.adapter.lora_B.weight)
    x = torch.randn(3, 5, 24, dtype=torch.double, requires_grad=True)
    assert layer._fusable(x)
    fused = layer(x)
    fused.sin().sum().backward()
    got = [x.grad.clone(), layer.adapter.lora_A.weight.grad.clone(), layer.adapter.lora_B.weight.grad.clone()]
    for t in (x, layer.adapter.lora_A.weight, layer.adapter.lora_B.weight):
        t.grad = None
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias) + layer.adapter(x)
    reference.sin().sum().backward()
    torch.testing.assert_close(fused, reference)
    for g, want in zip(got, [x.grad, layer.adapter.lora_A.weight.grad, layer.adapter.lora_B.weight.grad]):
        torch.testing.assert_close(g, want)
    assert layer.weight.grad is None
