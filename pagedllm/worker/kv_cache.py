"""The KV pool: one K and one V tensor for all layers, allocated once (seed 001 "KV Cache Pool").

Shape `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`. The host-side swap pool
has the same layout and exists only when preemption swaps. Swaps and copy-on-write copies move
whole blocks across every layer in one indexed copy each.
"""
from __future__ import annotations

import torch

from pagedllm.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, num_cpu_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: masked-out slots of a gathered block are multiplied by 0 weights,
        # and 0 * NaN from uninitialised memory would poison the output.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        cpu_shape = (cfg.num_layers, num_cpu_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        pin = device.type == "cuda"
        self.k_cpu = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self.v_cpu = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        if pairs:
            dev, host = _indices(pairs, self.k.device)
            self.k_cpu[:, host.cpu()] = self.k[:, dev].cpu()
            self.v_cpu[:, host.cpu()] = self.v[:, dev].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        if pairs:
            host, dev = _indices(pairs, self.k.device)
            self.k[:, dev] = self.k_cpu[:, host.cpu()].to(self.k.device)
            self.v[:, dev] = self.v_cpu[:, host.cpu()].to(self.v.device)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(source, destination) device blocks, for copy-on-write."""
        if pairs:
            src, dst = _indices(pairs, self.k.device)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]


def _indices(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = zip(*pairs)
    return torch.tensor(first, device=device), torch.tensor(second, device=device)
