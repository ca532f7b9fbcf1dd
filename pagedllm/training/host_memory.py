"""Give freed tensor memory back to the OS on CPU training.

glibc's malloc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB),
so after the first micro-batch most tensors (activations, gradients) come from the heap, and the
heap keeps their pages when they are freed: the process's RSS never falls back and its peak is the
live memory plus whatever the heap kept. Fixing the threshold (`mallopt(M_MMAP_THRESHOLD)`, which
also turns the dynamic raise off) makes every tensor of at least that size its own mapping,
unmapped on free. Cheaper than `malloc_trim` after every micro-batch (which walks the whole heap).

Off by default: measured on `bench finetune`'s full fine-tune (2-core EPYC, 2026-11-28, ours only,
4 steps, load ~1.5-2), 1 MiB took peak RSS 5,802 -> 4,434 MiB but tokens/s 192.9 -> 148.5 (every
large tensor is a fresh mapping, page-faulted in again), 4 MiB 5,512 MiB at 185.0 tok/s. Set
PAGEDLLM_MALLOC_MMAP_THRESHOLD (bytes) to trade speed for peak memory (docs/training.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("pagedllm.training")

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
DEFAULT_THRESHOLD_BYTES = 0  # glibc's own (see above)
ENV = "PAGEDLLM_MALLOC_MMAP_THRESHOLD"  # bytes; 0 leaves glibc's dynamic threshold


def threshold_bytes() -> int:
    value = os.environ.get(ENV)
    return int(value) if value else DEFAULT_THRESHOLD_BYTES


def fix_mmap_threshold(nbytes: int | None = None) -> bool:
    """Set glibc's mmap threshold to `nbytes` for this process; False where there is no glibc
    (musl, macOS) or the threshold is 0 (left alone)."""
    nbytes = threshold_bytes() if nbytes is None else nbytes
    if nbytes <= 0:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # no libc to load, or one without mallopt
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    log.debug("mallopt(M_MMAP_THRESHOLD, %d): %s", nbytes, ok)
    return ok
