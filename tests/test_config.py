"""The engine's dtype: what `auto` means on each device, and explicit dtypes honoured."""
from __future__ import annotations

import pytest
import torch

from pagedllm.config import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("config_dtype", ["bfloat16", "float16", "float32", None])
def test_auto_is_fp32_on_cpu_whatever_the_checkpoint(config_dtype):
    assert resolve_dtype("auto", config_dtype, CPU) is torch.float32


@pytest.mark.parametrize("config_dtype, supported, expected", [
    ("bfloat16", True, torch.bfloat16),
    ("float16", True, torch.float16),
    ("float32", True, torch.bfloat16),  # fp32 checkpoints run in half precision on GPUs, as in vLLM
    (None, True, torch.bfloat16),
    ("bfloat16", False, torch.float16),  # no bf16 before compute capability 8.0
    ("float32", False, torch.float16),
    ("float16", False, torch.float16),
])
def test_auto_on_a_gpu_follows_the_checkpoint_and_the_hardware(config_dtype, supported, expected):
    assert resolve_dtype("auto", config_dtype, CUDA, bf16_supported=supported) is expected


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("requested", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_honoured(device, requested):
    assert resolve_dtype(requested, "bfloat16", device, bf16_supported=True) is getattr(torch, requested)


def test_explicit_bf16_on_a_gpu_without_it_is_a_clear_error():
    with pytest.raises(ValueError, match="bfloat16.*float16"):
        resolve_dtype("bfloat16", "float32", CUDA, bf16_supported=False)


@pytest.mark.parametrize("args, field", [
    ({"decode_backend": "fast"}, "decode_backend"),
    ({"decode_backend": "fused", "attention_backend": "sdpa"}, "attention_backend"),
    ({"quantization": "int4"}, "quantization"),
])
def test_decode_backend_and_quantization_are_checked_at_the_entry_point(args, field):
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **args)
    assert EngineConfig(model="m", decode_backend="torch", quantization="int8").quantization == "int8"
