"""The gated MLP's gate/up weight as a plain matrix (gate channels, then up), for LoRA steps.

A step with gate/up adapter rows needs gate and up before the SiLU (their deltas go in first),
where the model keeps the weight as SwiGLU panels that give silu(gate) * up directly. Used by the
modules' path (lora/layers.py) and the fused C step's description (lora/fused.py).
"""
from __future__ import annotations

import torch

from pagedllm.layers.small_matmul import PackedWeight


def raw_panels(linear) -> PackedWeight | None:
    """The gate/up projection's small-M panels as a plain matrix (gate channels, then up), made
    on first use from its SwiGLU panels, which alternate a gate panel and an up panel: the same
    panels (the same bits: fp32, int8 or GGUF blocks) in another order, so no second copy of
    the weight is read from the checkpoint. None where there are no panels, or where the
    intermediate size is not a whole number of panels (each half is padded then)."""
    small = linear.small
    if small is None or not small.swiglu:
        return None
    raw = getattr(linear, "raw_small", None)
    if raw is None:
        from pagedllm.layers import kernels

        half, width = small.num_panels // 2, kernels.load().panel_width()  # (every pack of a process is this wide)
        if small.n // 2 != half * width:
            return None
        order = torch.cat((torch.arange(0, small.num_panels, 2), torch.arange(1, small.num_panels, 2)))
        lane = lambda t: None if t is None else t.view(small.num_panels, -1)[order].reshape(-1).contiguous()  # noqa: E731
        raw = linear.raw_small = PackedWeight(small.panels[order].contiguous(), lane(small.scale), lane(small.bias), small.n,
                                              small.k, swiglu=False, kind=small.kind)
    raw.int8_activations = linear.small.int8_activations
    return raw
