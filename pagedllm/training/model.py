"""The trainable decoder-only transformer: llama, mistral, qwen3 and a Mixtral-style moe.

Module and parameter names equal Hugging Face's (model.embed_tokens, model.layers.N.self_attn.q_proj,
..., lm_head; block_sparse_moe.gate / experts.N.w1|w2|w3 for moe), so a state dict -- sharded by DCP or
gathered for export -- is already a Hugging Face checkpoint. Layers live in a ModuleDict keyed by their
global index, so a pipeline stage that keeps layers 2..3 still names them model.layers.2/3 and every
stage's checkpoint shards fit together.

A stage may drop embed_tokens (not first), or norm and lm_head (not last): forward then takes hidden
states instead of token ids, or returns hidden states instead of logits.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pagedllm.layers.norm import RMSNorm as EngineRMSNorm  # fp32 norm, weight after the cast, as transformers
from pagedllm.training.config import ModelShapeConfig
from pagedllm.training.lean_ops import rms_norm, swiglu_down
from pagedllm.training.output_loss import output_loss


class RMSNorm(EngineRMSNorm):
    """The engine's RMSNorm; while training, the lean function (lean_ops.py: saves the input and 1/rms only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = rms_norm(x, self.weight, self.eps)
        return out if out is not None else super().forward(x)


@functools.lru_cache(maxsize=16)
def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim) in fp32, half-rotation layout (Hugging Face's rotate_half).
    Cached: every layer of every step asks for the same table."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin (seq, head_dim), or (batch, seq, head_dim) per token."""
    cos = (cos[None] if cos.dim() == 2 else cos)[:, :, None, :].to(x.dtype)
    sin = (sin[None] if sin.dim() == 2 else sin)[:, :, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """Each token's position within its example: 0 where the segment id changes, counting up after."""
    seq = segments.shape[1]
    index = torch.arange(seq, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


class Attention(nn.Module):
    """Grouped-query attention. Head counts come from the projections' local widths, so the same code
    runs on a tensor-parallel shard holding heads/tp of the heads."""

    def __init__(self, cfg: ModelShapeConfig) -> None:
        super().__init__()
        self.head_dim = cfg.resolved_head_dim
        self.rope_theta = cfg.rope_theta
        self.kv_groups = cfg.num_attention_heads // cfg.num_kv_heads
        self.sliding_window = cfg.sliding_window if cfg.architecture == "mistral" else None
        self.attention_dropout = cfg.attention_dropout
        q_width, kv_width = cfg.num_attention_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        qkv_bias = cfg.architecture == "qwen2"  # Qwen2 has biases on q, k and v (and nowhere else)
        self.q_proj = nn.Linear(cfg.hidden_size, q_width, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_width, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_width, bias=qkv_bias)
        self.o_proj = nn.Linear(q_width, cfg.hidden_size, bias=False)
        if cfg.architecture == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Context parallelism (training/context_parallel.py): this rank holds load-balanced chunks of
        # the sequence; `ring` gives their global positions and computes ring attention over them.
        self.ring = None

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """`segments` (batch, seq): packed examples' ids; each token then attends only within its
        example, and rotary positions restart at 0 for every example."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.ring is not None:
            return self._ring_forward(q, k, v)
        cos, sin = rotary_tables(seq, self.head_dim, self.rope_theta, x.device)
        if segments is not None:
            positions = segment_positions(segments)
            cos, sin = cos[positions], sin[positions]  # (batch, seq, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = self._window_mask(seq, x.device)
        if segments is not None:
            same = segments[:, :, None] == segments[:, None, :]
            causal = mask if mask is not None else torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            mask = (same & causal)[:, None]
        dropout = self.attention_dropout if self.training else 0.0  # drawn from torch's global RNG
        # grouped heads read in place (no repeated K/V saved for backward: a third of the copies' bytes at 9/3 heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                             enable_gqa=self.kv_groups > 1)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _ring_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of the sequence: rotary at their global positions, attention over the ring."""
        batch, seq = q.shape[:2]
        positions = self.ring.positions(seq, q.device)
        cos, sin = rotary_tables(seq * self.ring.size, self.head_dim, self.rope_theta, q.device)
        cos, sin = cos[positions], sin[positions]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.ring(q, k, v, self.sliding_window)  # k, v keep their kv heads: fewer bytes around the ring
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _window_mask(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """Mistral's sliding window: query i sees keys j with i - window < j <= i."""
        if self.sliding_window is None or seq <= self.sliding_window:
            return None
        i = torch.arange(seq, device=device)[:, None]
        j = torch.arange(seq, device=device)[None, :]
        return (j <= i) & (j > i - self.sliding_window)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_down(self.gate_proj(x), self.up_proj(x), self.down_proj)  # the product recomputed in backward


class Expert(nn.Module):
    """One Mixtral expert, named w1 (gate), w3 (up), w2 (down) as in Mixtral checkpoints."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return local_linear(self.w2, F.silu(local_linear(self.w1, x)) * local_linear(self.w3, x))


def local_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, on the weight's local tensor when tensor parallelism made it a Replicate DTensor
    (parallel.py's `ReplicatedMoE`): routing feeds each expert a data-dependent set of rows, which
    DTensor cannot express, so the MoE computes on plain tensors, as torchtitan's GroupedExperts does.
    `to_local`'s backward keeps the gradient Replicate: identical on every tp rank, no reduction."""
    weight = layer.weight
    return F.linear(x, weight.to_local()) if isinstance(weight, DTensor) else layer(x)


class SparseMoE(nn.Module):
    """Top-k routed experts (Mixtral): softmax router, top-k renormalised weights, and the Switch
    Transformer load-balancing loss E * sum_e(f_e * P_e) kept in `aux_loss` for the trainer to add.

    Every expert runs on every step, on an empty batch if it got no tokens, so each expert parameter
    always has a gradient -- FSDP's reduce-scatter then sees the same parameters on every rank."""

    def __init__(self, cfg: ModelShapeConfig) -> None:
        super().__init__()
        assert cfg.num_experts and cfg.num_experts_per_token
        self.top_k = cfg.num_experts_per_token
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.intermediate_size) for _ in range(cfg.num_experts))
        self.aux_loss: torch.Tensor | None = None
        # Context parallelism (training/context_parallel.py): this rank routes only its chunks of each
        # sequence; the balance loss's statistics are summed over this group to be the whole sequence's.
        self.cp_group: dist.ProcessGroup | None = None
        # Expert parallelism (training/expert_parallel.py) replaces `experts` by this rank's shard and
        # sets the all-to-all dispatch that sends each token to the rank holding its experts.
        self.dispatch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(local_linear(self.gate, flat).float(), dim=-1)
        top_weights, top_index = torch.topk(probs, self.top_k, dim=-1)
        top_weights = (top_weights / top_weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        if self.dispatch is not None:
            out = self.dispatch(flat, top_index, top_weights, self.experts)
        else:
            out = torch.zeros_like(flat)
            for e, expert in enumerate(self.experts):
                token_idx, slot = torch.where(top_index == e)
                y = expert(flat[token_idx]) * top_weights[token_idx, slot, None]
                out = out.index_add(0, token_idx, y)
        self.aux_loss = self._balance_loss(probs, top_index)
        return out.view(shape)

    def _balance_loss(self, probs: torch.Tensor, top_index: torch.Tensor) -> torch.Tensor:
        """E * sum_e(f_e * P_e) over the sequences' tokens: with context parallelism the per-expert
        counts and router probabilities are summed over the cp ranks first (the product is not a sum
        over tokens). Every cp rank then holds the same loss; the autograd all-reduce's backward sums
        their gradients, cp x each rank's share, and the data-parallel mean over cp divides it back."""
        num_experts = probs.shape[-1]
        counts = F.one_hot(top_index, num_experts).float().sum(dim=(0, 1))
        prob_sums, pairs, tokens = probs.sum(dim=0), top_index.numel(), probs.shape[0]
        if self.cp_group is not None:
            from torch.distributed.nn.functional import all_reduce

            dist.all_reduce(counts, group=self.cp_group)
            prob_sums = all_reduce(prob_sums, group=self.cp_group)
            size = dist.get_world_size(self.cp_group)  # every cp rank holds as many tokens
            pairs, tokens = pairs * size, tokens * size
        return num_experts * torch.sum(counts / pairs * prob_sums / tokens)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective activation checkpointing: keep matmul and attention outputs, recompute the cheap rest."""
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                  torch.ops.aten._scaled_dot_product_efficient_attention.default,
                  torch.ops.aten._scaled_dot_product_flash_attention.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class DecoderLayer(nn.Module):
    """Pre-norm block. `checkpointing` (None, "FULL" or "SELECTIVE") is set by parallel.py; recomputation
    wraps the block body here, so parameter names never gain a wrapper prefix."""

    def __init__(self, cfg: ModelShapeConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.architecture == "moe":
            self.block_sparse_moe = SparseMoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.checkpointing: str | None = None

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        if self.checkpointing is None or not torch.is_grad_enabled():
            return self._block(x, segments)
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        kwargs = {"context_fn": context_fn} if self.checkpointing == "SELECTIVE" else {}
        return checkpoint(self._block, x, segments, use_reentrant=False, **kwargs)

    def _block(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        # segments only when given: tensor parallelism's input plan counts the attention's inputs
        h = x + (self.self_attn(normed) if segments is None else self.self_attn(normed, segments))
        return h + self.feed_forward(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Hugging Face's `model.` prefix: embeddings, the layer stack and the final norm."""

    def __init__(self, cfg: ModelShapeConfig) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in range(cfg.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        for layer in self.layers.values():
            h = layer(h) if segments is None else layer(h, segments)
        return self.norm(h) if self.norm is not None else h


class TrainingCausalLM(nn.Module):
    """Token ids (or a previous stage's hidden states) in, logits (or hidden states) out."""

    def __init__(self, cfg: ModelShapeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """`segments`: packed examples (Attention.forward); None is one causal sequence per row.
        `keep` (batch, seq), bool: logits only for those positions, flattened (a fine-tune's trained
        tokens: the output layer is a fifth of a small model's FLOPs and its logits the largest
        activation, and the prompts' and the padding's are never used). With `targets` (the kept
        positions' labels) the mean cross-entropy instead of the logits (output_loss.py: the
        logits are never made whole)."""
        h = self.model(x) if segments is None else self.model(x, segments)
        if self.lm_head is None:
            return h
        h = h if keep is None else h[keep]
        return self.lm_head(h) if targets is None else output_loss(h, self.lm_head, targets)

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Mean load-balancing loss over this module's MoE layers from the last forward, or None."""
        losses = [layer.block_sparse_moe.aux_loss for layer in self.model.layers.values()
                  if hasattr(layer, "block_sparse_moe") and layer.block_sparse_moe.aux_loss is not None]
        return torch.stack(losses).mean() if losses else None


def init_weights(model: nn.Module, std: float, seed: int) -> None:
    """Deterministic N(0, std) init for linears and embeddings, ones for norms, from `seed` alone: every
    rank builds the identical full model, so sharding afterwards reproduces the single-process run."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        with torch.no_grad():
            if name.endswith(".bias"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_model(cfg: ModelShapeConfig, seed: int) -> TrainingCausalLM:
    model = TrainingCausalLM(cfg)
    init_weights(model, cfg.initializer_range, seed)
    return model


def num_params(cfg: ModelShapeConfig, active_only: bool = False) -> int:
    """Parameter count from the config alone (no model needed); `active_only` counts top-k experts."""
    hd, h = cfg.resolved_head_dim, cfg.hidden_size
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_kv_heads)
    attn += 2 * hd if cfg.architecture == "qwen3" else 0
    attn += hd * (cfg.num_attention_heads + 2 * cfg.num_kv_heads) if cfg.architecture == "qwen2" else 0
    ffn = 3 * h * cfg.intermediate_size
    if cfg.architecture == "moe":
        experts = cfg.num_experts_per_token if active_only else cfg.num_experts
        ffn = ffn * experts + h * cfg.num_experts
    per_layer = attn + ffn + 2 * h
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * per_layer + embeddings + h


def flops_per_token(cfg: ModelShapeConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x active non-embedding-lookup parameters plus
    the attention score/value matmuls, 12 x layers x heads x head_dim x seq_len (PaLM appendix B)."""
    dense = num_params(cfg, active_only=True) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attention = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.resolved_head_dim * seq_len
    return 6 * dense + attention


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

