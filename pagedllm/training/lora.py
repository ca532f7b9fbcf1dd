"""LoRA: a frozen linear layer plus a trained low-rank update, y = W x + b + scaling * B A dropout(x).

A starts as Kaiming-uniform and B as zeros (PEFT's default), so before the first step the adapted
model is the base model exactly. Module paths stay Hugging Face's: the frozen weight is still
`...q_proj.weight`, the pair is `...q_proj.lora_A.weight` / `...q_proj.lora_B.weight`, which is
PEFT's naming after its `base_model.model.` prefix (adapters/peft_format.py). Everything but the
pairs is frozen, so the optimizer, the gradient norm and a checkpoint (ignore_frozen_params) see
only the adapter.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.adapters.peft_format import LoraSettings


class LoraPair(nn.Module):
    """The adapter of one linear layer: lora_A [rank, in], lora_B [out, rank], and its dropout."""

    def __init__(self, in_features: int, out_features: int, settings: LoraSettings) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, settings.rank, bias=False)
        self.lora_B = nn.Linear(settings.rank, out_features, bias=False)
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.scaling = settings.scaling
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def delta(self) -> torch.Tensor:
        """scaling * B @ A: what merging adds to the frozen weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


class LoraLinearFn(torch.autograd.Function):
    """y = x W^T + b + scaling (x A^T) B^T for a frozen W, in two matrix products and one accumulating
    one, with nothing elementwise on the layer's width: the update is added by the GEMM into the base
    output (addmm_), its scaling applied on the rank-wide side, and in backward the adapter's input
    gradient is accumulated by the GEMM into the base's (dx = dy W + (s dy B) A). On a CPU the
    separate scale, add and gradient-sum passes over [tokens, width] cost as much as the adapter's
    own products. Saves x and x A^T, as autograd through the modules does; W gets no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        low = flat @ lora_a.t()
        y = flat @ weight.t() if bias is None else torch.addmm(bias, flat, weight.t())
        y.addmm_(low, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(flat, weight, lora_a, lora_b, low)
        ctx.scaling, ctx.shape = scaling, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, weight, lora_a, lora_b, low = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_low = (g @ lora_b).mul_(ctx.scaling)
        grad_b = (g.t() @ low).mul_(ctx.scaling)
        grad_a = grad_low.t() @ flat
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).addmm_(grad_low, lora_a).view(ctx.shape)
        return grad_x, None, None, grad_a, grad_b, None


class LoraLinear(nn.Linear):
    """A frozen nn.Linear (same parameter names) with a LoRA pair beside it."""

    def __init__(self, base: nn.Linear, settings: LoraSettings) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        self.adapter = LoraPair(base.in_features, base.out_features, settings)

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = self.adapter
        if self._fusable(x):
            return LoraLinearFn.apply(x, self.weight, self.bias, pair.lora_A.weight, pair.lora_B.weight, pair.scaling)
        return F.linear(x, self.weight, self.bias) + self.adapter(x)

    def _fusable(self, x: torch.Tensor) -> bool:
        """LoraLinearFn's case: no dropout, a frozen base, one dtype throughout, no autocast (which
        would cast inside the products and not the accumulation)."""
        pair = self.adapter
        return (isinstance(pair.dropout, nn.Identity) and not self.weight.requires_grad
                and not torch.is_autocast_enabled(x.device.type)
                and x.dtype == self.weight.dtype == pair.lora_A.weight.dtype == pair.lora_B.weight.dtype)


def _targets(model: nn.Module, names: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every linear layer in the decoder layers whose leaf name is targeted."""
    found = []
    for path, module in model.named_modules():
        parent_path, _, leaf = path.rpartition(".")
        if leaf in names and isinstance(module, nn.Linear) and ".layers." in f".{path}":
            found.append((model.get_submodule(parent_path), leaf, module))
    return found


def freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def apply_lora(model: nn.Module, settings: LoraSettings, make_layer=None) -> int:
    """Freeze `model` and wrap its targeted linear layers; returns how many were wrapped.
    `make_layer(path, linear, settings)` builds the wrapper (QLoRA's keeps the weight as blocks)."""
    freeze(model)
    build = make_layer or (lambda path, linear, s: LoraLinear(linear, s))
    paths = {id(m): p for p, m in model.named_modules()}
    targets = _targets(model, settings.target_modules)
    for parent, leaf, linear in targets:
        setattr(parent, leaf, build(paths[id(linear)], linear, settings))
    return len(targets)


def _rename(name: str) -> str:
    """Our parameter name -> PEFT's module path (the pair sits in `.adapter`, PEFT has it directly under the layer)."""
    return name.replace(".adapter.lora_", ".lora_")


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, also when `t` is an FSDP shard (DTensor: a collective, every rank must call it)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def adapter_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's adapter tensors under PEFT's module paths (as adapter_state gives them)."""
    return {_rename(name): t for name, t in state.items() if ".adapter.lora_" in name}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's module paths (`model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    return {_rename(name): _full(p) for name, p in model.named_parameters() if ".adapter.lora_" in name}


def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy an adapter's tensors (PEFT's module paths) into the wrapped model; every pair must be filled."""
    params = {_rename(name): p for name, p in model.named_parameters() if ".adapter.lora_" in name}
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"the adapter does not fit this model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(p.shape) != tuple(tensors[name].shape):
                raise ValueError(f"{name}: the adapter has shape {tuple(tensors[name].shape)}, the model {tuple(p.shape)}")
            p.copy_(tensors[name])


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict (Hugging Face names) with every LoRA pair merged into its weight: W + scaling B A."""
    state = {}
    for path, module in model.named_modules():
        if ".adapter" in f"{path}.":
            continue
        if isinstance(getattr(module, "adapter", None), LoraPair):
            pair = module.adapter
            delta = (_full(pair.lora_B.weight) @ _full(pair.lora_A.weight)) * pair.scaling
            state[f"{path}.weight"] = _full(module.dense_weight()) + delta
            if module.bias is not None:
                state[f"{path}.bias"] = _full(module.bias)
            continue
        for name, p in module.named_parameters(recurse=False):
            state[f"{path}.{name}" if path else name] = _full(p)
    return state
