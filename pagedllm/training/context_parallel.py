"""Context parallelism: each sequence sharded over the `cp` mesh dimension, attention as a ring.

PyTorch's own `context_parallel` (torch.distributed.tensor.experimental) runs on CUDA only; this is
the ring it implements, over torch.distributed's point-to-point sends, so the same code runs on
gloo (the tests) and NCCL:

* Load balancing for causal attention: the sequence is cut into 2 x cp chunks and rank i keeps
  chunks i and 2cp-1-i, so every rank has as many (query, key) pairs below the diagonal.
* Forward: cp steps; at step s a rank holds the keys/values of rank (i - s) mod cp, computes its
  queries' attention to them as a block (masked by global positions) and merges the block into its
  output with an online softmax (log-sum-exp merge); meanwhile it passes the keys/values on.
* Backward: the same ring again, recomputing each block's probabilities from the saved log-sum-exp;
  the key/value gradients travel with their keys/values and arrive home after cp hops.

Only one block's (local x local) score matrix exists at a time, and autograd keeps only this rank's
q, k, v, output and log-sum-exp: activation memory per rank scales with 1/cp of the sequence.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def chunk_positions(seq_len: int, rank: int, size: int) -> torch.Tensor:
    """Global positions of the tokens rank `rank` of `size` holds in a sequence of `seq_len`:
    chunks `rank` and 2 x size - 1 - rank of 2 x size equal chunks."""
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat((first, second))


def shard_sequence(t: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced part of `t` along its sequence dim (token ids, labels)."""
    return t.index_select(dim, chunk_positions(t.shape[dim], rank, size).to(t.device))


class Ring:
    """One rank's place in the context-parallel ring: its process group, rank and size."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    @functools.lru_cache(maxsize=8)
    def positions(self, local_len: int, device: torch.device, of_rank: int | None = None) -> torch.Tensor:
        """Global positions of `of_rank`'s (default this rank's) `local_len` tokens."""
        rank = self.rank if of_rank is None else of_rank
        return chunk_positions(local_len * self.size, rank, self.size).to(device)

    def start_pass(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start sending `tensor` to the next rank and receiving the previous rank's (same shape)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return received, dist.batch_isend_irecv(ops)

    def pass_on(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send `tensor` to the next rank, return the previous rank's."""
        received, requests = self.start_pass(tensor)
        for request in requests:
            request.wait()
        return received

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries (batch, heads, local, head_dim) over the whole
        sequence's keys/values, whose local parts k, v (batch, kv_heads, local, head_dim) every rank
        holds. Keys/values travel with their kv_heads only; each block repeats them for its queries."""
        return _RingAttention.apply(q, k, v, self, window)


def _block_mask(ring: Ring, local: int, source: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(local, local) bool: may this rank's query attend to `source`'s key (causal, optional window)."""
    pq = ring.positions(local, device)[:, None]
    pk = ring.positions(local, device, source)[None, :]
    mask = pk <= pq
    return mask & (pk > pq - window) if window is not None else mask


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: kv head h serves query heads h x groups .. (h + 1) x groups - 1."""
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: the query-head copies summed back onto their kv head."""
    if groups == 1:
        return t
    batch, heads, length, dim = t.shape
    return t.view(batch, heads // groups, groups, length, dim).sum(dim=2)


def _block_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf"))


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own backward (the ring again); math in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, window: int | None):
        dtype, local, groups = q.dtype, q.shape[2], q.shape[1] // k.shape[1]
        qf, kv = q.float(), torch.stack((k.float(), v.float()))
        out = lse = None
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            incoming, requests = ring.start_pass(kv) if step < ring.size - 1 else (None, [])  # overlaps the block
            scores = _block_scores(qf, _repeat_heads(kv[0], groups), _block_mask(ring, local, source, window, q.device))
            block_lse = scores.logsumexp(dim=-1)
            # rows with no visible key (-inf) contribute nothing; step 0 (the diagonal) has none
            safe = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
            block_out = torch.matmul(torch.exp(scores - safe[..., None]), _repeat_heads(kv[1], groups))
            if out is None:
                out, lse = block_out, block_lse
            else:
                merged = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
                lse = merged
            for request in requests:
                request.wait()
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.window = ring, window
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, window, local, groups = ctx.ring, ctx.window, q.shape[2], q.shape[1] // k.shape[1]
        qf, dout = q.float(), grad_out.float()
        scale = q.shape[-1] ** -0.5
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(qf)
        kv = torch.stack((k.float(), v.float()))
        dkv = torch.zeros_like(kv)
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            k_block, v_block = _repeat_heads(kv[0], groups), _repeat_heads(kv[1], groups)
            scores = _block_scores(qf, k_block, _block_mask(ring, local, source, window, q.device))
            probs = torch.exp(scores - lse[..., None])
            dkv[1] += _sum_groups(torch.matmul(probs.transpose(-1, -2), dout), groups)
            dscores = probs * (torch.matmul(dout, v_block.transpose(-1, -2)) - delta)
            dq += torch.matmul(dscores, k_block) * scale
            dkv[0] += _sum_groups(torch.matmul(dscores.transpose(-1, -2), qf) * scale, groups)
            if step < ring.size - 1:  # keys/values move on with their gradients so far
                kv, dkv = ring.pass_on(torch.cat((kv, dkv))).chunk(2)
            else:  # the last hop takes the gradients home
                dkv = ring.pass_on(dkv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Every attention layer attends over the ring of `cp_mesh` (with tensor parallelism each tp rank's
    ring carries its own heads: the cp group holds one tp index); inputs must be `shard_sequence`d."""
    from pagedllm.training.model import Attention, SparseMoE

    ring = Ring(cp_mesh.get_group())
    for module in model.modules():
        if isinstance(module, Attention):
            module.ring = ring
        elif isinstance(module, SparseMoE):  # its balance loss from the whole sequence's routing
            module.cp_group = ring.group
