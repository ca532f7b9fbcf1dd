"""NVMe offload of the optimizer states (`memory_config.nvme_offload`), ZeRO-Infinity's idea on
PyTorch's own pieces.

With cpu_offload, FSDP keeps parameters and gradients in host memory and the optimizer steps there, its
states (AdamW's exp_avg and exp_avg_sq: twice the parameters' bytes) resident in host memory too.
With nvme_offload (which includes cpu_offload's FSDP policy) the states live in files instead, one
NumPy .npy file per parameter and state (NumPy's own format, opened as a memory map), under
`memory_config.nvme_offload_dir` (default `<checkpoint_dir>/nvme-offload`), one folder per rank and
model part. Each step streams them through host memory one parameter at a time: map that parameter's
files, run the configured optimizer (torch's AdamW / Adam, or our LAMB) on that parameter alone --
updating the mapped states in place, so the page cache writes them back -- and unmap them. Host memory
holds one parameter's states at a time instead of all of them.

What stays in memory: each state's step counter (a scalar). What a checkpoint holds: the same
optimizer state dict as without offload (`state_dict` reads the files; `load_state_dict` writes them),
so a run resumes exactly and checkpoints move freely between offloaded and resident runs.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
# dtypes NumPy lacks are stored bit for bit in an integer of their width
_BIT_DTYPES = {torch.bfloat16: (torch.int16, np.int16)}


class StateFiles:
    """One .npy file per (parameter index, state name) in `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, index: int, key: str) -> Path:
        return self.folder / f"{index:05d}.{key}.npy"

    def write(self, index: int, key: str, tensor: torch.Tensor) -> None:
        local = _storable(tensor.detach().to_local() if isinstance(tensor, DTensor) else tensor.detach()).cpu()
        array = np.lib.format.open_memmap(self.path(index, key), mode="w+", dtype=local.numpy().dtype, shape=tuple(local.shape))
        array[...] = local.numpy()
        del array

    def open(self, index: int, key: str, like: torch.Tensor) -> torch.Tensor:
        """The file mapped read-write as a tensor shaped and placed like `like` (the parameter)."""
        array = np.load(self.path(index, key), mmap_mode="r+")
        local = torch.from_numpy(array)
        dtype = like.dtype
        if dtype in _BIT_DTYPES:
            local = local.view(dtype)
        if isinstance(like, DTensor):
            return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                      shape=like.shape, stride=like.stride())
        return local

    def bytes_on_disk(self) -> int:
        return sum(path.stat().st_size for path in self.folder.glob("*.npy"))


def _storable(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype in _BIT_DTYPES:
        return tensor.view(_BIT_DTYPES[tensor.dtype][0])
    if tensor.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"nvme_offload: cannot store optimizer state of dtype {tensor.dtype}")
    return tensor


def _offloaded(value) -> bool:
    """A state tensor that goes to a file (the step counter, a scalar, stays in memory)."""
    return isinstance(value, torch.Tensor) and value.ndim > 0


class OnDisk:
    """What `optimizer.state[param][name]` holds for a state kept in a file. The names stay in the
    state (DCP's load reads which states a parameter has from them); the values are in the files."""

    def __repr__(self) -> str:
        return "OnDisk()"


ON_DISK = OnDisk()


class NvmeOffloadOptimizer(torch.optim.Optimizer):
    """`optimizer`'s algorithm and hyper-parameters, its per-parameter states kept in files (see the
    module docstring). Steps one parameter at a time with a throw-away instance of the same class."""

    def __init__(self, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        if optimizer.state:
            raise ValueError("nvme_offload wraps a fresh optimizer (its state is already in memory)")
        self.algorithm = type(optimizer)
        self.files = StateFiles(folder)
        super().__init__(optimizer.param_groups, optimizer.defaults)

    def _indexed(self) -> Iterator[tuple[int, dict, torch.Tensor]]:
        """(index, group, parameter) in torch's state_dict order: the index names the files too."""
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                yield index, group, param
                index += 1

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("nvme_offload: closures are not supported")
        for index, group, param in self._indexed():
            if param.grad is not None:
                self._step_one(index, group, param)
        return None

    def _step_one(self, index: int, group: dict, param: torch.Tensor) -> None:
        """Map this parameter's files, step it alone (the states update in place), unmap them."""
        hyper = {k: v for k, v in group.items() if k != "params"}
        single = self.algorithm([{**hyper, "params": [param]}])
        kept = self.state.get(param)
        if kept:
            single.state[param] = self._mapped(index, param, kept)
        single.step()
        state = single.state.pop(param)
        if kept:  # the mapped states are already written; keep the counters
            self.state[param] = {key: ON_DISK if _offloaded(value) else value for key, value in state.items()}
        else:  # first step: the states were just created in memory; from now on they live in files
            self._store(index, param, state)
        del single, state

    def _mapped(self, index: int, param: torch.Tensor, kept: dict) -> dict:
        return {key: self.files.open(index, key, param) if value is ON_DISK else value for key, value in kept.items()}

    def _store(self, index: int, param: torch.Tensor, state: dict) -> None:
        for key, value in state.items():
            if _offloaded(value):
                self.files.write(index, key, value)
        self.state[param] = {key: ON_DISK if _offloaded(value) else value for key, value in state.items()}

    def state_dict(self) -> dict:
        """torch's optimizer state dict with every state read back from its file (a copy): what a
        checkpoint saves, the same as an optimizer without offload would give."""
        packed = super().state_dict()
        for index, _, param in self._indexed():
            kept = self.state.get(param)
            if kept:
                packed["state"][index] = {key: _copy(value) if _offloaded(value) else value
                                          for key, value in self._mapped(index, param, kept).items()}
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as torch does, then move the states to the files."""
        super().load_state_dict(state_dict)
        loaded = dict(self.state)
        self.state.clear()
        for index, _, param in self._indexed():
            if param in loaded:
                self._store(index, param, loaded[param])


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return DTensor.from_local(tensor.to_local().clone(), tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    return tensor.clone()


def offload_folder(checkpoint_dir: str | Path, configured: str | None, rank: int, part: int) -> Path:
    base = Path(configured) if configured else Path(checkpoint_dir) / "nvme-offload"
    return base / f"rank{rank:05d}" / f"part{part}"
