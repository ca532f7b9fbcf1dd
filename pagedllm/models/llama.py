"""The Llama decoder family: Llama 2/3.x, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

They differ only in biases, per-head q/k norms, head_dim and sliding windows, so one module
with those switches (read from `ModelConfig`) serves all four. Q/K/V and gate/up projections
are fused into single matmuls — fewer, larger GEMMs run closer to peak on CPU — and the loader
fills the fused weights shard by shard from the checkpoint's separate tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.attention import AttentionMetadata, PagedAttention
from pagedllm.layers.linear import GateUpLinear, Linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import Rope, RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding_window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, sliding_window)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = apply_rotary(qk, rope)  # q and k rotated in one pass
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads :], v, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding_window: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.sliding_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)  # the same rows for every layer
        for layer in self.layers:
            x = layer(rope, x, meta)
        return self.norm(x)


class CausalLM(nn.Module):
    """Module names follow transformers' checkpoints (model.*, lm_head) so weights map by name."""

    # checkpoint projection -> (fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_position: int, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.fused = None  # the fused decode step (models/fused_decode.py), once attached
        self.model = DecoderModel(cfg, max_position, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def linears(self) -> list[Linear]:
        return [module for module in self.modules() if isinstance(module, Linear)]

    def quantize_and_pack(self, quantization: str | None, panel_width: int | None) -> None:
        """Quantize every projection and the LM head (`quantization`), and pack them for the
        small-M kernel whose panels are `panel_width` wide (layers/small_matmul.py)."""
        for linear in self.linears():
            quantized = linear.quantize(quantization) if quantization is not None else None
            if panel_width is not None:
                linear.pack_small(panel_width, quantized)

    def pack_linears(self) -> None:
        """Reorder every projection's weight for oneDNN (see layers/linear.py); the lm_head keeps
        its dense weight when it is the (tied) embedding table."""
        for module in self.linears():
            module.pack(keep_dense=module.weight is self.model.embed_tokens.weight)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def step_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    logit_rows: torch.Tensor) -> torch.Tensor:
        """The logits of a step's sampled rows: one fused C call for a small all-decode step
        when the fused decode step is attached, else the modules (the reference)."""
        if self.fused is not None and self.fused.accepts(meta, input_ids.shape[0]):
            return self.fused(input_ids, positions, meta, logit_rows)
        hidden = self(input_ids, positions, meta)
        return self.compute_logits(hidden.index_select(0, logit_rows))
