"""Adapters the engine cannot serve are refused at add_request with a ValueError naming why; the
engine keeps serving. Config clashes are refused by name."""
from __future__ import annotations

import pytest

from lora_adapters import make_peft_adapter
from tiny_models import build_model

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.weights import LoRAError
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def bad_adapters(lora_base, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("bad-adapters")
    other = build_model(root / "other-base", "llama", hidden_size=32, intermediate_size=64)
    return {
        "rank": (make_peft_adapter(lora_base, root / "rank", 16, 16, ["q_proj"], 0), "rank r=16 exceeds max_lora_rank=8"),
        "target": (make_peft_adapter(lora_base, root / "target", 2, 2, ["lm_head"], 0), "target module 'lm_head' is not supported"),
        "missing": (root / "nowhere", "has no adapter_config.json"),
        "base": (make_peft_adapter(other, root / "base", 2, 2, ["q_proj"], 0), "made for another base model"),
    }


@pytest.fixture(scope="module")
def engine(lora_base):
    return LLMEngine.from_engine_args(str(lora_base), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)


@pytest.mark.parametrize("kind", ["rank", "target", "missing", "base"])
def test_bad_adapter_is_refused_naming_why(engine, bad_adapters, adapters, kind):
    path, why = bad_adapters[kind]
    with pytest.raises(LoRAError, match=why):
        engine.add_request(f"bad-{kind}", [5, 6, 7], SamplingParams(max_tokens=2), lora_request=LoRARequest(kind, 90, str(path)))
    assert not engine.has_unfinished_requests()
    engine.add_request(f"good-{kind}", [5, 6, 7], SamplingParams(max_tokens=2),
                       lora_request=LoRARequest("attn", 1, str(adapters["attn"])))
    while engine.has_unfinished_requests():
        engine.step()


def test_an_id_names_one_adapter(engine, adapters):
    engine.add_lora(LoRARequest("attn", 1, str(adapters["attn"])))
    with pytest.raises(LoRAError, match="lora_int_id 1 is already adapter 'attn'"):
        engine.add_lora(LoRARequest("mlp", 1, str(adapters["mlp"])))


def test_lora_request_needs_enable_lora(lora_base, adapters):
    engine = LLMEngine.from_engine_args(str(lora_base), block_size=4)
    with pytest.raises(ValueError, match="without enable_lora=True"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, str(adapters["attn"])))


@pytest.mark.parametrize("args,name", [(dict(num_scheduler_steps=4), "num_scheduler_steps > 1"),
                                       (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                                        "speculative_config"),
                                       (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras=2 must be >= max_loras=4")])
def test_config_clashes_are_named(lora_base, args, name):
    with pytest.raises(ValueError, match=name):
        LLMEngine.from_engine_args(str(lora_base), enable_lora=True, **args)


def test_lora_request_fields_are_checked():
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
