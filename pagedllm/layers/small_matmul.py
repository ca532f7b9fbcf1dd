"""Small-M matmuls (decode: a few activation rows) through the C kernel in csrc/small_matmul.c.

At M <= 16 a linear's time is the time to read its weight, so the weight is packed once, at load
time, into the layout that streams best: panels of `panel_width()` output channels (16 on
AVX-512, 8 on AVX2), k-major, one contiguous run per thread. fp32 or int8 (weight-only, with
per-channel scales, layers/quantization.py). `matmul()` is the standalone entry point, tested
against `x @ W^T`; the fused decode step (models/fused_decode.py) reads the same packed weights.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedllm.layers import kernels

WEIGHT_F32, WEIGHT_I8 = 0, 1
MAX_ROWS = 16  # the decode sizes these kernels are for; larger batches go to oneDNN


class MatrixStruct(ctypes.Structure):
    """kernels.h's Matrix."""

    _fields_ = [
        ("panels", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("num_panels", ctypes.c_int64),
        ("dtype", ctypes.c_int32), ("reserved", ctypes.c_int32),
        ("panel_capacity", ctypes.c_int64), ("lane_capacity", ctypes.c_int64),
    ]


@dataclass
class PackedWeight:
    """A weight in panels, with the tensors the C struct points into (kept alive here)."""

    panels: torch.Tensor  # [num_panels, k, width] float32 or int8
    scale: torch.Tensor | None  # [num_panels * width] (int8)
    bias: torch.Tensor | None  # [num_panels * width]
    n: int
    k: int
    swiglu: bool = False  # panels alternate gate, up: the output is silu(gate) * up, n / 2 wide

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
        for another panel width is refused, not read past its end)."""
        lanes = min((t.numel() for t in (self.scale, self.bias) if t is not None), default=0)
        return MatrixStruct(
            self.panels.data_ptr(), _ptr(self.scale), _ptr(self.bias), self.n, self.k, self.num_panels,
            WEIGHT_I8 if self.panels.dtype == torch.int8 else WEIGHT_F32, 0,
            self.panels.numel() * self.panels.element_size(), lanes,
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


def pack_swiglu(weight: torch.Tensor, width: int, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> PackedWeight:
    """A fused gate/up weight [2 I, k] (gate rows first) packed with gate and up panels
    alternating, so one thread's share yields finished silu(gate) * up channels."""
    halves = [pack(part, width, None if bias is None else b, None if scale is None else s)
              for part, b, s in zip(weight.chunk(2), _chunks(bias), _chunks(scale))]
    gate, up = halves
    panels = torch.stack((gate.panels, up.panels), dim=1).flatten(0, 1)
    interleave = lambda a, b: None if a is None else torch.stack((a.view(gate.num_panels, -1), b.view(gate.num_panels, -1)), 1).reshape(-1)  # noqa: E731
    return PackedWeight(panels, interleave(gate.scale, up.scale), interleave(gate.bias, up.bias), 2 * gate.n, gate.k, swiglu=True)


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
