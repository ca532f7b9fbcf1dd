"""The tensor-parallel group of one engine: its rank, its size and the collectives the model needs.

Each engine makes a process group of its own from a TCPStore (gloo on CPU, NCCL on CUDA)
instead of torch.distributed's default group, so an engine in a process that uses
torch.distributed for something else (a trainer, another engine) disturbs nothing. A rank that
dies makes the others' next collective fail at once (the connection closes), so a crash surfaces
as an error in the engine, not a hang; `timeout` bounds a rank that hangs.
"""
from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

_TIMEOUT = datetime.timedelta(seconds=120)


class ParallelGroup:
    """`backend` carries the model's tensors (NCCL on CUDA); `host` (gloo) the step metadata."""

    def __init__(self, rank: int, size: int, backend: "dist.Backend", host: "dist.Backend"):
        self.rank, self.size, self.backend, self.host = rank, size, backend, host

    @classmethod
    def connect(cls, rank: int, size: int, port: int, device: torch.device, store: "dist.TCPStore | None" = None,
                timeout: datetime.timedelta = _TIMEOUT) -> "ParallelGroup":
        """Rank 0 passes the store it created (it listens on `port`); the others connect to it."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
        host = dist.ProcessGroupGloo(dist.PrefixStore("pagedllm-tp-host", store), rank, size, timeout)
        backend = host
        if device.type == "cuda":
            backend = dist.ProcessGroupNCCL(dist.PrefixStore("pagedllm-tp-device", store), rank, size)
        return cls(rank, size, backend, host)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self.backend.allreduce([tensor]).wait()
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's [rows, n] part, side by side ([rows, size * n]) on rank 0; None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.is_first else []
        self.backend.gather(parts, [tensor.contiguous()], options).wait()
        return torch.cat(parts[0], dim=1) if self.is_first else None

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends `obj` (pickled); every rank returns it."""
        size = torch.tensor([0], dtype=torch.int64)
        data = pickle.dumps(obj) if self.is_first else b""
        size[0] = len(data)
        self.host.broadcast(size, 0).wait()
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_first else torch.empty(int(size[0]), dtype=torch.uint8)
        self.host.broadcast(buffer, 0).wait()
        return obj if self.is_first else pickle.loads(buffer.numpy().tobytes())


def shard_of(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s `size`-long slice of `tensor` along `dim`; zero-padded past the end (a
    vocabulary that the ranks do not divide evenly)."""
    start = rank * size
    available = max(0, min(size, tensor.shape[dim] - start))
    part = tensor.narrow(dim, min(start, tensor.shape[dim]), available)
    if available == size:
        return part
    pad = list(tensor.shape)
    pad[dim] = size - available
    return torch.cat([part, tensor.new_zeros(pad)], dim=dim)
