"""The KV pool: one K and one V tensor for all layers, allocated once (the KV cache pool).

Shape `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`. The host-side swap pool
has the same layout and exists only when preemption swaps. Swaps and copy-on-write copies move
whole blocks across every layer in one indexed copy each; the device-side block indices come
from the step's staged metadata, so applying the maps adds no transfer of its own.
"""
from __future__ import annotations

import math
import mmap

import torch

from pagedllm.config import ModelConfig


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """A zeroed pool. In (unpinned) host memory it is an anonymous memory map: the kernel gives
    zero pages, and only on first write, so the pool takes memory as blocks are used rather than
    all at start-up (`torch.zeros` writes every byte: the default model's 360 MiB pool was
    resident before the first request). Same values, same layout; `secure_kv_blocks` still wipes."""
    if device.type != "cpu" or pin:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def bytes_per_layer_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return bytes_per_block(cfg, block_size, dtype) // cfg.num_layers


class KVCache:
    """`host_pool`: the pool itself lives in host memory (layer-wise offload, worker/kv_offload.py),
    pinned when the compute device is a GPU."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, num_cpu_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, host_pool: bool = False):
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: masked-out slots of a gathered block are multiplied by 0 weights,
        # and 0 * NaN from uninitialised memory would poison the output.
        pool_device = torch.device("cpu") if host_pool else device
        pin = host_pool and device.type == "cuda"
        self.k = zeros(shape, dtype, pool_device, pin)
        self.v = zeros(shape, dtype, pool_device, pin)
        cpu_shape = (cfg.num_layers, num_cpu_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        pin = device.type == "cuda"
        self.k_cpu = zeros(cpu_shape, dtype, torch.device("cpu"), pin)
        self.v_cpu = zeros(cpu_shape, dtype, torch.device("cpu"), pin)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def swap_out(self, device_blocks: torch.Tensor, host_blocks: list[int]) -> None:
        """Copy device blocks (an index on the device) into host blocks: one copy for K and V."""
        moved = torch.stack((self.k[:, device_blocks], self.v[:, device_blocks]))
        if moved.device != self.k_cpu.device:
            moved = moved.to(self.k_cpu.device)
        self.k_cpu[:, host_blocks] = moved[0]
        self.v_cpu[:, host_blocks] = moved[1]

    def swap_in(self, host_blocks: list[int], device_blocks: torch.Tensor) -> None:
        """Copy host blocks into device blocks (an index on the device): one copy for K and V."""
        moved = torch.stack((self.k_cpu[:, host_blocks], self.v_cpu[:, host_blocks]))
        if moved.device != self.k.device:
            moved = moved.to(self.k.device, non_blocking=True)
        self.k[:, device_blocks] = moved[0]
        self.v[:, device_blocks] = moved[1]

    def copy(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copy-on-write: device blocks to device blocks, across every layer."""
        self.k[:, destinations] = self.k[:, sources]
        self.v[:, destinations] = self.v[:, sources]

    def zero(self, blocks: torch.Tensor) -> None:
        """Secure mode: wipe freed device blocks (an index on the pool's device), every layer."""
        self.k[:, blocks] = 0
        self.v[:, blocks] = 0

    def zero_host(self, host_blocks: list[int]) -> None:
        """Secure mode: wipe freed host swap blocks."""
        self.k_cpu[:, host_blocks] = 0
        self.v_cpu[:, host_blocks] = 0
