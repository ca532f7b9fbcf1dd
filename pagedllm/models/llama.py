"""The Llama decoder family: Llama 2/3.x, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

They differ only in biases, per-head q/k norms, head_dim and sliding windows, so one module
with those switches (read from `ModelConfig`) serves all four. Q/K/V and gate/up projections
are fused into single matmuls — fewer, larger GEMMs run closer to peak on CPU — and the loader
fills the fused weights shard by shard from the checkpoint's separate tensors.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.group import ParallelGroup
from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers import triton_ops
from pagedllm.layers.attention import AttentionMetadata, PagedAttention
from pagedllm.layers.linear import GateUpLinear, Linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import Rope, RotaryEmbedding, apply_rotary

# Which dimension of a checkpoint tensor tensor parallelism splits across ranks: the output rows
# of a column-parallel projection, the input columns of a row-parallel one (whose partial sums an
# all-reduce adds up after it).
COLUMN_PARALLEL = {"weight": 0, "bias": 0}
ROW_PARALLEL = {"weight": 1}


class Attention(nn.Module):
    triton = False  # rotary as one Triton kernel (layers/triton_ops.py; the GPU path)

    def __init__(self, cfg: ModelConfig, sliding_window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.qkv_proj.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj.tp_dims = COLUMN_PARALLEL
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.o_proj.tp_dims = ROW_PARALLEL
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
        qk = triton_ops.rotary(qk, rope) if self.triton else apply_rotary(qk, rope)  # q and k rotated in one pass
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads :], v, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, 2 * intermediate_size, bias=cfg.mlp_bias)
        self.gate_up_proj.tp_dims = COLUMN_PARALLEL
        self.down_proj = Linear(intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.down_proj.tp_dims = ROW_PARALLEL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # silu(gate) * up


class DecoderLayer(nn.Module):
    """Under tensor parallelism the attention and the feed-forward each end in one all-reduce."""

    def __init__(self, cfg: ModelConfig, sliding_window: int | None, mlp: nn.Module, group: ParallelGroup | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        self.group = group

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.group is None:
            x = x + self.self_attn(rope, self.input_layernorm(x), meta)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.group.all_reduce(self.self_attn(rope, self.input_layernorm(x), meta))
        return x + self.group.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, dtype: torch.dtype, make_mlp: Callable[[int], nn.Module],
                 group: ParallelGroup | None):
        super().__init__()
        if group is None:  # (an empty weight: a random init on the meta device imported torch._dynamo, ~1.5 s)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w, make_mlp(i), group) for i, w in enumerate(cfg.sliding_windows))
        self.layer_hook = None  # layer-wise KV offload (worker/kv_offload.py): before_layer / after_layer
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)  # the same rows for every layer
        if self.layer_hook is None:
            for layer in self.layers:
                x = layer(rope, x, meta)
            return self.norm(x)
        for index, layer in enumerate(self.layers):
            self.layer_hook.before_layer(index)
            x = layer(rope, x, meta)
            self.layer_hook.after_layer(index)
        return self.norm(x)


class CausalLM(nn.Module):
    """Module names follow transformers' checkpoints (model.*, lm_head) so weights map by name.
    Subclasses for other families change the feed-forward (`make_mlp`) and where checkpoint
    tensors go (`checkpoint_target`).

    Under tensor parallelism (`group`), `cfg` is this rank's part of the model (ModelConfig.shard)
    and the vocabulary is split by rows; rank 0 gathers the logits."""

    # checkpoint projection -> (fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_position: int, dtype: torch.dtype, group: ParallelGroup | None = None):
        super().__init__()
        self.config = cfg
        self.group = group
        self.fused = None  # the fused decode step (models/fused_decode.py), once attached
        self.model = DecoderModel(cfg, max_position, dtype, self.make_mlp, group)
        vocab_rows = self.model.embed_tokens.num_embeddings  # this rank's rows
        self.lm_head = Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.lm_head.tp_dims = {"weight": 0}
        self.lm_head.q4_kind = "Q8_0"
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def restrict_vocab(self, token_ids: list[int]) -> None:
        """Score only `token_ids` (a draft model's reduced vocabulary): the LM head keeps their
        rows, in that order, and no longer shares the embedding's weight."""
        rows = self.lm_head.weight.detach()[torch.tensor(token_ids)]
        self.lm_head = Linear(rows.shape[1], rows.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(rows, requires_grad=False)
        self.lm_head.q4_kind = "Q8_0"
        self.config = replace(self.config, vocab_size=len(token_ids))

    def make_mlp(self, layer_index: int) -> nn.Module:
        return MLP(self.config)

    def checkpoint_target(self, key: str) -> tuple[str, int, Callable[[torch.Tensor], torch.Tensor]]:
        """Where checkpoint tensor `key` goes: (parameter name, shard id, the part of the
        parameter it fills). Separate q/k/v and gate/up projections fill shards of fused ones."""
        for ckpt_name, (fused, index) in self.packed_modules.items():
            if f".{ckpt_name}." in key:
                name = key.replace(f".{ckpt_name}.", f".{fused}.")
                sizes = self.get_submodule(name.rsplit(".", 1)[0]).shard_sizes
                return name, index, lambda p: p.narrow(0, sum(sizes[:index]), sizes[index])
        return key, 0, lambda p: p

    def tp_dim(self, name: str) -> int | None:
        """The dimension of parameter `name`'s checkpoint tensors that ranks split, if any."""
        module_name, _, attr = name.rpartition(".")
        return getattr(self.get_submodule(module_name), "tp_dims", {}).get(attr)

    def expected_shards(self, name: str) -> set[int]:
        """The shard ids that must all be loaded into parameter `name`."""
        module = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
        sizes = getattr(module, "shard_sizes", None)
        return set(range(len(sizes))) if sizes else {0}

    def linears(self) -> list[Linear]:
        return [module for module in self.modules() if isinstance(module, Linear)]

    def quantize_and_pack(self, quantization: str | None, panel_width: int | None) -> None:
        """Quantize every projection and the LM head (`quantization`), and pack them for the
        small-M kernel whose panels are `panel_width` wide (layers/small_matmul.py)."""
        for linear in self.linears():
            quantized = linear.quantize(quantization) if quantization not in (None, "none") and linear.quantizable else None
            if panel_width is not None:
                linear.pack_small(panel_width, quantized)

    def pack_linears(self) -> None:
        """Reorder every projection's weight for oneDNN (see layers/linear.py); the lm_head keeps
        its dense weight when it is the (tied) embedding table."""
        for module in self.linears():
            module.pack(keep_dense=module.weight is self.model.embed_tokens.weight)

    def use_triton_ops(self) -> None:
        """RMSNorm, rotary and SiLU-up as single Triton kernels (the GPU path, layers/triton_ops.py)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, GateUpLinear, Attention)):
                module.triton = True

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits; under tensor parallelism on rank 0 only (None elsewhere).
        A step may sample no row at all (every chunk a prompt's non-final part): the LM head is
        then skipped on every rank alike (they all see the same rows), not run on nothing."""
        if hidden.shape[0] == 0:
            empty = torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=hidden.device)
            return empty if self.group is None or self.group.is_first else None
        logits = self.lm_head(hidden).float()
        if self.group is None:
            return logits
        logits = self.group.gather_columns(logits)
        return logits[:, : self.config.vocab_size] if logits is not None else None

    def step_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    logit_rows: torch.Tensor, fused: bool = False, lora=None) -> torch.Tensor | None:
        """The logits of a step's sampled rows: through the attached fused decode step in one C
        call when `fused` (the planner's call: step/planner.py), with the rows' LoRA adapters
        `lora` (lora/fused.py), else the modules (the reference)."""
        if fused:
            return self.fused(input_ids, positions, meta, logit_rows, lora) if lora is not None else \
                self.fused(input_ids, positions, meta, logit_rows)
        hidden = self(input_ids, positions, meta)
        return self.compute_logits(hidden.index_select(0, logit_rows))
