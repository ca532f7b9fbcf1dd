"""A step's host-side metadata, moved to the device in one copy per dtype.

Input ids, positions, slot mapping, block tables, context lengths, sample rows and sampling
parameters are built on the host (numpy and Python lists, never torch tensors, so nothing there
waits on the device). Each builder adds its arrays under a name; `to()` concatenates them per
dtype, makes one transfer each (pinned and asynchronous on CUDA) and hands back views by name.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}


class Staging:
    def __init__(self) -> None:
        self._arrays: dict[np.dtype, list[tuple[str, np.ndarray]]] = {}

    def add(self, name: str, values: Iterable | np.ndarray, dtype: type = np.int64, shape: tuple[int, ...] | None = None) -> None:
        array = np.asarray(values, dtype=dtype)
        if shape is not None:
            array = array.reshape(shape)
        self._arrays.setdefault(array.dtype, []).append((name, array))

    def host(self) -> dict[str, np.ndarray]:
        """The arrays by name, as built (for a CPU-only consumer that reads host memory itself)."""
        return {name: array for arrays in self._arrays.values() for name, array in arrays}

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        views: dict[str, torch.Tensor] = {}
        for dtype, arrays in self._arrays.items():
            flat = np.concatenate([a.reshape(-1) for _, a in arrays]) if len(arrays) > 1 else arrays[0][1].reshape(-1)
            moved = _to_device(flat, _TORCH_DTYPES[dtype], device)
            offset = 0
            for name, array in arrays:
                views[name] = moved[offset : offset + array.size].view(array.shape)
                offset += array.size
        return views


def _to_device(flat: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # Through pinned memory, so the copy is asynchronous; the caching host allocator keeps
        # the pinned block alive until the copy has run.
        return torch.from_numpy(flat).pin_memory().to(device, non_blocking=True)
    return torch.as_tensor(flat, dtype=dtype, device=device)
