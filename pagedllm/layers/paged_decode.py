"""Decode attention over the paged KV pool as a small C kernel (csrc/paged_decode.c), built with
the machine's C compiler the first time an engine starts and loaded through ctypes.

Why not PyTorch ops: the eager path gathers each sequence's blocks into a padded copy and runs
SDPA over it — three passes over the KV bytes, and SDPA's CPU kernel runs single-query decode far
below the memory system's speed. Written as gather → dot → softmax → weighted sum and compiled by
torch.compile, inductor fuses the gather but emits per-element index checks, divisions and
horizontal reductions: 9–10 GB/s effective on a machine that reads 27 GB/s, plus ~0.15 ms of
dispatch per call. The kernel reads each K/V row of a context once, scores a tile of 8 rows
against all the query heads of its GQA group while they are in cache, keeps its sums in vector
registers, and is called for ~10 µs.

Prefill chunks have their own kernel (csrc/prefill_attention.c, `run_prefill_kernel`): with
many query rows attention is a small matrix product, so it is laid out as one (a tile of query
rows transposed, each K element broadcast against it) rather than as a dot product per row, and
its work items are (tile of 16 rows, head), so even a short prompt with few heads makes many.

`paged_decode` below is the same computation in PyTorch: the reference both kernels are tested
against. Without a C compiler, for dtypes other than fp32, or for a head_dim that is not a
multiple of 8, the engine uses SDPA instead. The build, its cache and the
fallback are shared with the other CPU kernels (layers/kernels.py).
"""
from __future__ import annotations

import ctypes

import torch

from pagedllm.layers import kernels
from pagedllm.layers.kernels import compiler  # noqa: F401  (re-exported for callers and tests)

# The KV pool element types the C kernels read, each one's code (csrc/kernels.h KV_*: the fused
# step's Model.kv_dtype) and its kernels' suffix. float16 is llama.cpp's default cache type.
POOL_DTYPES = {torch.float32: (0, "f32"), torch.bfloat16: (1, "bf16"), torch.float16: (2, "f16")}


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Reference. q: [B, Hkv, G, D] (query head h = kv head h // G, as transformers' repeat_kv
    groups them); caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, nb]; ctx_lens: [B].
    `window` <= 0 means no sliding window. Returns [B, Hkv, G, D]."""
    batch, num_blocks = block_tables.shape
    k = k_cache[block_tables].flatten(1, 2)  # [B, L, Hkv, D]
    v = v_cache[block_tables].flatten(1, 2)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale
    positions = torch.arange(k.shape[1], device=q.device)
    last = (ctx_lens - 1)[:, None]
    visible = positions[None, :] <= last
    if window > 0:
        visible = visible & (last - positions[None, :] < window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, dim=-1), v)


def load() -> ctypes.CDLL | None:
    """The kernel library (layers/kernels.py), built on first use; None if it cannot be built."""
    return kernels.load()


def run_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               ctx_lens: torch.Tensor, window: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_decode` through the C kernel, into `out` if given. q and out may have any stride
    between sequences (q is then read where it lies); caches must be contiguous fp32 on the CPU,
    and every context must fit its block table (the block manager guarantees both)."""
    library = _available(load(), "paged decode")
    q = q if _rows_dense(q) else q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if not _rows_dense(out) or out.shape != q.shape:
        raise ValueError("out must have q's shape and dense rows")
    tables = block_tables.to(torch.int64).contiguous()
    lens = ctx_lens.to(torch.int64).contiguous()
    batch, num_kv_heads, group, head_dim = q.shape
    _check_pool(k_cache, v_cache, q)
    if tables.dim() != 2 or tables.shape[0] != batch or lens.shape != (batch,):
        raise ValueError(f"block_tables must be [{batch}, max_blocks] and ctx_lens [{batch}]")
    kernel = getattr(library, f"paged_decode_{POOL_DTYPES[k_cache.dtype][1]}")
    failed = kernel(
        q.data_ptr(), q.stride(0), _span(q), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], tables.data_ptr(),
        tables.numel(), lens.data_ptr(), lens.numel(), out.data_ptr(), out.stride(0), _span(out), batch, tables.shape[1],
        k_cache.shape[1], num_kv_heads, group, head_dim, window, scale, torch.get_num_threads(),
    )
    kernels.check_status(failed, library, "paged decode", head_dim)
    return out


def run_prefill_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       ctx_len: int, window: int, scale: float, out: torch.Tensor,
                       library: ctypes.CDLL | None = None) -> torch.Tensor:
    """Causal attention of one prefill chunk's query rows q: [q_len, Hkv, G, D] (the last q_len
    positions of a context of ctx_len, whose K/V the pool already holds) into out, through the C
    kernel (csrc/prefill_attention.c): row r is `paged_decode` of a context of
    ctx_len - q_len + r + 1. `library`: another build of the kernels (tests)."""
    library = _available(library or load(), "prefill attention")
    if not (_rows_dense(q) and _rows_dense(out)) or out.shape != q.shape:
        raise ValueError("q and out must have the same shape and dense rows")
    table = block_table.to(torch.int64).contiguous().view(-1)
    q_len, num_kv_heads, group, head_dim = q.shape
    _check_pool(k_cache, v_cache, q)
    kernel = getattr(library, f"prefill_attention_{POOL_DTYPES[k_cache.dtype][1]}")
    failed = kernel(
        q.data_ptr(), q.stride(0), _span(q), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], table.data_ptr(),
        table.numel(), q_len, ctx_len, out.data_ptr(), out.stride(0), _span(out), k_cache.shape[1], num_kv_heads, group,
        head_dim, window, scale, torch.get_num_threads(),
    )
    kernels.check_status(failed, library, "prefill attention", head_dim)
    return out


def _available(library: ctypes.CDLL | None, kernel: str) -> ctypes.CDLL:
    if library is None:
        raise RuntimeError(f"the {kernel} kernel is unavailable (no C compiler, or the build failed)")
    return library


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> None:
    """The pool the kernels index by block id: both caches contiguous [num_blocks, block_size,
    Hkv, D] of one shape and one of POOL_DTYPES, whose heads match q's (fp32; the
    kernel checks ids against the pool)."""
    _, num_kv_heads, _, head_dim = q.shape
    if (k_cache.shape != v_cache.shape or k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.dtype not in POOL_DTYPES or v_cache.dtype != k_cache.dtype
            or q.dtype != torch.float32):
        raise ValueError("the KV caches must be contiguous float32, bfloat16 or float16 [num_blocks, block_size, Hkv, D] matching "
                         "q (float32)")


def _span(x: torch.Tensor) -> int:
    """Floats from x's first element to the end of its storage: what a kernel may touch."""
    return x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()


def _rows_dense(x: torch.Tensor) -> bool:
    """Whether each row of x (all but the first dim) is contiguous: all the kernel needs."""
    _, _, group, dim = x.shape
    return x.stride()[1:] == (group * dim, dim, 1)


def kernel_supported(k_cache: torch.Tensor) -> bool:
    """fp32 CPU caches whose head_dim is a multiple of 8 (the kernel's vector width)."""
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and k_cache.shape[-1] % 8 == 0
    )
