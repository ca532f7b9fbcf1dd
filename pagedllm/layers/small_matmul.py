"""Small-M matmuls (decode: a few activation rows) through the C kernel in csrc/small_matmul.c.

At M <= 16 a linear's time is the time to read its weight, so the weight is packed once, at load
time, into the layout that streams best: panels of `panel_width()` output channels (16 on
AVX-512, 8 on AVX2), k-major, one contiguous run per thread. fp32, int8 (weight-only, with
per-channel scales) or GGUF blocks of 32 (Q8_0, Q4_0, Q4_1, kept bit for bit; layers/quantization.py). `matmul()` is the standalone entry point, tested
against `x @ W^T`; the fused decode step (models/fused_decode.py) reads the same packed weights.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.layers import kernels
from pagedllm.layers.kernel_interface import WEIGHT_KINDS
from pagedllm.layers.kernel_interface import Matrix as MatrixStruct
from pagedllm.layers.quantization import BLOCK, Blocks

WEIGHT_F32, WEIGHT_I8 = WEIGHT_KINDS["WEIGHT_F32"], WEIGHT_KINDS["WEIGHT_I8"]
WEIGHT_Q8_0, WEIGHT_Q4 = WEIGHT_KINDS["WEIGHT_Q8_0"], WEIGHT_KINDS["WEIGHT_Q4"]
MAX_ROWS = 16  # the decode sizes these kernels are for; larger batches go to oneDNN
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # GGUF's bytes per block of 32


@dataclass
class PackedWeight:
    """A weight in panels, with the tensors the C struct points into (kept alive here)."""

    panels: torch.Tensor  # [num_panels, k, width] float32 or int8; [num_panels, bytes] uint8 for blocks
    scale: torch.Tensor | None  # [num_panels * width] (int8)
    bias: torch.Tensor | None  # [num_panels * width]
    n: int
    k: int
    swiglu: bool = False  # panels alternate gate, up: the output is silu(gate) * up, n / 2 wide
    kind: int | None = None  # the C dtype; None: from the panels' dtype (fp32 or int8)
    # Q4/Q8_0 only: multiply activations quantized to int8 per block of 32 with integer dot
    # products (Matrix.int8_activations, csrc/small_matmul.c): faster, not exact
    int8_activations: bool = False

    @property
    def num_panels(self) -> int:
        return self.panels.shape[0]

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size() + sum(
            t.numel() * t.element_size() for t in (self.scale, self.bias) if t is not None
        )

    def struct(self) -> MatrixStruct:
        """The C description, with the capacities the kernels check it against (a weight packed
        for another panel width is refused, not read past its end; a block-quantized one's
        panel bytes hold its fp16 scales, so check_matrix measures them by the kind's block size)."""
        kind = self.kind if self.kind is not None else WEIGHT_I8 if self.panels.dtype == torch.int8 else WEIGHT_F32
        lanes = min((t.numel() for t in (self.scale, self.bias) if t is not None), default=0)
        return MatrixStruct(
            panels=self.panels.data_ptr(), scale=_ptr(self.scale), bias=_ptr(self.bias), n=self.n, k=self.k,
            num_panels=self.num_panels, dtype=kind, panel_capacity=self.panels.numel() * self.panels.element_size(),
            lane_capacity=lanes, int8_activations=int(self.int8_activations and kind in (WEIGHT_Q8_0, WEIGHT_Q4)),
        )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _panels(w: torch.Tensor, width: int) -> torch.Tensor:
    """[n, k] -> [ceil(n / width), k, width], channels past n zero."""
    n, k = w.shape
    padded = torch.zeros(-(-n // width) * width, k, dtype=w.dtype)
    padded[:n] = w
    return padded.view(-1, width, k).transpose(1, 2).contiguous()


def _lanes(v: torch.Tensor | None, num_panels: int, width: int) -> torch.Tensor | None:
    if v is None:
        return None
    out = torch.zeros(num_panels * width, dtype=torch.float32)
    out[: v.numel()] = v.float()
    return out


def pack(weight: torch.Tensor, width: int, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> PackedWeight:
    """Pack W [n, k] (y = x W^T): fp32, or int8 with per-channel `scale` ([n], required then)."""
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError("an int8 weight needs its per-channel scales, and only an int8 weight takes them")
    w = weight.detach().cpu()
    w = w if w.dtype == torch.int8 else w.float()
    panels = _panels(w, width)
    return PackedWeight(panels, _lanes(scale, panels.shape[0], width), _lanes(bias, panels.shape[0], width), *w.shape)


def pack_blocks(blocks: Blocks, width: int, bias: torch.Tensor | None = None) -> PackedWeight:
    """Pack GGUF blocks (layers/quantization.py) into panels of `width` channels, block by block
    (csrc/kernels.h): the bits of every scale and quant unchanged, Q4_0 as Q4_1 with m = -8 d."""
    n, row_bytes = blocks.rows.shape
    size = _BLOCK_BYTES[blocks.kind]
    nb = row_bytes // size
    rows = np.zeros((-(-n // width) * width, nb, size), dtype=np.uint8)
    rows[:n] = blocks.rows.reshape(n, nb, size)
    panels = rows.reshape(-1, width, nb, size).transpose(0, 2, 1, 3)  # [P, nb, width, size]
    d = panels[..., :2]
    if blocks.kind == "Q8_0":
        parts = [d, panels[..., 2:].transpose(0, 1, 3, 2)]
    else:
        quants = panels[..., -16:].transpose(0, 1, 3, 2)
        if blocks.kind == "Q4_1":
            m = panels[..., 2:4]
        else:
            m = (np.float16(-8) * np.ascontiguousarray(d).view(np.float16)).view(np.uint8)
        parts = [d, m, quants]
    flat = np.concatenate([np.ascontiguousarray(p).reshape(p.shape[0], nb, -1) for p in parts], axis=2)
    num_panels = flat.shape[0]
    return PackedWeight(torch.from_numpy(flat.reshape(num_panels, -1).copy()), None, _lanes(bias, num_panels, width),
                        n, nb * BLOCK, kind=WEIGHT_Q8_0 if blocks.kind == "Q8_0" else WEIGHT_Q4)


def pack_swiglu(weight: torch.Tensor | Blocks, width: int, bias: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> PackedWeight:
    """A fused gate/up weight [2 I, k] (gate rows first) packed with gate and up panels
    alternating, so one thread's share yields finished silu(gate) * up channels."""
    if isinstance(weight, Blocks):
        half = weight.rows.shape[0] // 2
        halves = [pack_blocks(Blocks(weight.kind, part), width, b)
                  for part, b in zip((weight.rows[:half], weight.rows[half:]), _chunks(bias))]
    else:
        halves = [pack(part, width, None if bias is None else b, None if scale is None else s)
                  for part, b, s in zip(weight.chunk(2), _chunks(bias), _chunks(scale))]
    gate, up = halves
    panels = torch.stack((gate.panels, up.panels), dim=1).flatten(0, 1)
    interleave = lambda a, b: None if a is None else torch.stack((a.view(gate.num_panels, -1), b.view(gate.num_panels, -1)), 1).reshape(-1)  # noqa: E731
    return PackedWeight(panels, interleave(gate.scale, up.scale), interleave(gate.bias, up.bias), 2 * gate.n, gate.k, swiglu=True,
                        kind=gate.kind)


def _chunks(t: torch.Tensor | None) -> tuple:
    return (None, None) if t is None else t.chunk(2)


def matmul(library: ctypes.CDLL, x: torch.Tensor, w: PackedWeight, num_threads: int | None = None) -> torch.Tensor:
    """x [m, k] fp32 -> x W^T [m, n] (or silu(gate) * up [m, n / 2] for a gate/up weight)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x must be float32 [m, {w.k}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n // 2 if w.swiglu else w.n, dtype=torch.float32, device=x.device)
    struct = w.struct()
    status = library.small_matmul(ctypes.byref(struct), x.data_ptr(), x.shape[0], x.shape[1], x.numel(), out.data_ptr(),
                                  out.shape[1], out.numel(), int(w.swiglu), num_threads or torch.get_num_threads())
    kernels.check_status(status, library, "small matmul")
    return out
