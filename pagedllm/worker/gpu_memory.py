"""The KV pool's size on a GPU: what `gpu_memory_utilization` of the card leaves after the weights,
the activations of the largest step and what lives outside PyTorch's allocator (vLLM's rule).

The runner loads the weights, runs one profiling step at the largest batch the scheduler can
form (`max_num_batched_tokens` prompt tokens over up to `max_num_seqs` sequences, each sampling
with top-k/top-p and logprobs, the sampler's heaviest path) against a scratch pool, and reads
PyTorch's peak allocation and the device's free memory; the pool gets the rest of the share.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryReading:
    """Bytes, read right after the profiling step."""

    total: int  # the device's memory (torch.cuda.mem_get_info()[1])
    free: int  # free on the device now (mem_get_info()[0])
    reserved: int  # held by PyTorch's caching allocator (torch.cuda.memory_reserved())
    peak_allocated: int  # PyTorch's peak during the profile: weights + activations (max_memory_allocated())
    scratch: int = 0  # the scratch pool's bytes, counted in peak_allocated but not needed later


def kv_cache_budget(reading: MemoryReading, utilization: float) -> int:
    """Bytes the KV pool may take: utilization x total, less PyTorch's peak and the memory used
    outside PyTorch's allocator (the CUDA context, cuBLAS workspaces, other processes)."""
    outside_torch = max(reading.total - reading.free - reading.reserved, 0)
    budget = int(reading.total * utilization) - (reading.peak_allocated - reading.scratch) - outside_torch
    if budget <= 0:
        used = (reading.peak_allocated - reading.scratch + outside_torch) / GiB
        raise ValueError(
            f"gpu_memory_utilization={utilization} of {reading.total / GiB:.1f} GiB leaves no room for the KV cache: "
            f"weights, activations of the largest step and memory outside PyTorch take {used:.1f} GiB; raise "
            "gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or pass kv_cache_memory")
    return budget
