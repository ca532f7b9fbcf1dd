"""FP8 training (`memory_config.precision = FP8`) with torchao's float8 training, as torchtitan does it.

`convert_to_float8_training` swaps the model's nn.Linear layers for torchao's Float8Linear before any
parallelism is applied: each of their matmuls (forward, and the two of backward) casts its operands to
float8 (e4m3; gradients e5m2 with tensorwise scaling) with dynamic scales and multiplies them with
`torch._scaled_mm`. Two recipes (`memory_config.fp8_recipe`):

* tensorwise: one scale per tensor -- the fastest (torchao reports >= 1.3x on H100 for large shapes);
* rowwise: one scale per row (and per column of the other operand) -- closer to BF16 when a few large
  values would flatten a whole tensor's scale.

Everything that is not one of those matmuls (norms, attention scores, softmax, the loss) runs in
BF16, as in a BF16 job: FP8 takes BF16's mixed-precision policy (parallel.LOW_PRECISION).

Float8 matmuls need an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper and newer). On a CPU the
very same Float8Linear runs with `emulate=True`: the values are rounded to float8 and scaled exactly as
on the GPU, and the matmul is done in higher precision -- the numerics of FP8 training without its
speed, which is what the tests compare against BF16. A CUDA GPU older than 8.9 is refused.

Which layers: every nn.Linear whose two dimensions are multiples of 16 (what `_scaled_mm` requires),
except lm_head (the logits feed the loss directly; torchtitan leaves the output projection in high
precision too) and a MoE router (its top-k choice flips on small changes).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


FP8_ALIGNMENT = 16
KEPT_IN_HIGH_PRECISION = ("lm_head", "block_sparse_moe.gate")


def fp8_device_problem() -> str | None:
    """Why FP8 cannot run here, or None: a CUDA GPU below compute capability 8.9, or torchao missing.
    Without CUDA, training runs on the CPU, where float8 is emulated."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "FP8 training needs torchao (pip install 'pagedllm[fp8]')"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        return f"FP8 needs a GPU with compute capability >= 8.9; this one is {major}.{minor} (use BF16)"
    return None


def converts(module: nn.Module, fqn: str) -> bool:
    """torchao's module_filter_fn: which nn.Linear layers become Float8Linear."""
    if not isinstance(module, nn.Linear):
        return False
    if any(fqn == name or fqn.endswith("." + name) for name in KEPT_IN_HIGH_PRECISION):
        return False
    return module.in_features % FP8_ALIGNMENT == 0 and module.out_features % FP8_ALIGNMENT == 0


def float8_config(recipe: str, device: torch.device):
    """torchao's recipe; emulated unless on a CUDA device (fp8_device_problem rules out old GPUs)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=device.type != "cuda")


def apply_fp8(model: nn.Module, recipe: str) -> list[str]:
    """Swap the eligible linears for Float8Linear in place; returns their names (logged, tested)."""
    from torchao.float8 import convert_to_float8_training

    device = next(model.parameters()).device
    names = [name for name, module in model.named_modules() if converts(module, name)]
    convert_to_float8_training(model, config=float8_config(recipe, device), module_filter_fn=converts)
    return names


def float8_layers(model: nn.Module) -> list[str]:
    """Names of the model's Float8Linear layers."""
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
