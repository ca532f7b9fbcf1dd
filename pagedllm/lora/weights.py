"""One adapter's weights, validated against the base model and laid out per projection site.

Our model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (models/llama.py), so an
adapter's pairs are regrouped per fused site: A of every targeted shard stacked along the rank
([in, R] once transposed), B placed in the shard's output columns of one [R, out] matrix with
the scaling folded in. A site's delta is then two matmuls whatever it targets — x @ A^T @ B^T,
Punica's shrink then expand — and untargeted shards get exact zeros.

Validation happens here, at load time, with a message that says why: a rank above
`max_lora_rank`, a module that is not one of q/k/v/o/gate/up/down in a decoder layer, a missing
file (adapters/peft_format.py), or tensor shapes that do not fit the base (an adapter made for
another model). Nothing half-loaded ever reaches a step.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.adapters.peft_format import AdapterFormatError, load_adapter

# checkpoint projection -> (our site, shard index within it)
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


class LoRAError(ValueError):
    """An adapter that cannot be served on this engine; the message names the adapter and why."""


@dataclass(frozen=True)
class SiteShape:
    """What a site's base projection takes and gives: in features and its shards' output sizes."""

    in_features: int
    shard_sizes: tuple[int, ...]


@dataclass
class SiteDelta:
    """One site's low-rank pair: delta = (x @ a_t) @ b_t, a_t [in, R], b_t [R, out] (scaled)."""

    a_t: torch.Tensor
    b_t: torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype, pair_dtype: torch.dtype | None = None) -> "SiteDelta":
        """In `dtype` (the model's: what the modules multiply), its values rounded to `pair_dtype`."""
        move = lambda t: t.to(device, pair_dtype or dtype).to(dtype).contiguous()  # noqa: E731
        return SiteDelta(move(self.a_t), move(self.b_t))

    @property
    def nbytes(self) -> int:
        return (self.a_t.numel() + self.b_t.numel()) * self.a_t.element_size()


@dataclass
class AdapterWeights:
    """A loaded adapter: its rank, a delta for each (layer, site) it targets (the modules' form),
    and each targeted projection's own pair (layer, index in TARGETS) -> (a [r, k], b_t [r, n]
    scaled): the fused C step's form (lora/fused.py), with no zero blocks to multiply."""

    lora_int_id: int
    rank: int
    sites: dict[tuple[int, str], SiteDelta]
    projections: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]

    def to(self, device: torch.device, dtype: torch.dtype, pair_dtype: torch.dtype | None = None) -> "AdapterWeights":
        """On `device` for a model computing in `dtype`, the pairs kept in `pair_dtype` (vLLM's
        lora_dtype; default `dtype`). The fused C step's pairs are stored in `pair_dtype` (it
        widens bfloat16 as it reads them); the modules' sites stay in `dtype` with their values
        rounded to `pair_dtype`, so a prefill through the modules and a decode step through the C
        step add the same deltas (on CPU in float32 either way: no copy, the same tensors)."""
        move = lambda t: t.to(device, pair_dtype or dtype).contiguous()  # noqa: E731
        return AdapterWeights(self.lora_int_id, self.rank, {k: d.to(device, dtype, pair_dtype) for k, d in self.sites.items()},
                              {k: (move(a), move(b)) for k, (a, b) in self.projections.items()})

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.sites.values()) + sum(a.nbytes + b.nbytes for a, b in self.projections.values())


def load_weights(name: str, lora_int_id: int, path: str, shapes: dict[tuple[int, str], SiteShape],
                 max_lora_rank: int) -> AdapterWeights:
    """Read and validate the PEFT adapter at `path` against the base's `shapes`; LoRAError says why not."""
    try:
        settings, _base, tensors = load_adapter(Path(path))
    except (AdapterFormatError, OSError) as exc:
        raise LoRAError(f"adapter {name!r}: {exc}") from None
    if settings.rank > max_lora_rank:
        raise LoRAError(f"adapter {name!r}: rank r={settings.rank} exceeds max_lora_rank={max_lora_rank}")
    pairs: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    projections = {}
    for module in sorted({n.rsplit(".", 2)[0] for n in tensors}):
        layer, site, shard = _site_of(name, module, shapes)
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        if a.shape[0] > max_lora_rank:
            raise LoRAError(f"adapter {name!r}: {module} has rank {a.shape[0]}, above max_lora_rank={max_lora_rank}")
        shape = shapes[(layer, site)]
        if a.shape[1] != shape.in_features or b.shape[0] != shape.shard_sizes[shard]:
            raise LoRAError(f"adapter {name!r}: {module} maps {a.shape[1]} -> {b.shape[0]} features, the base model's "
                            f"{shape.in_features} -> {shape.shard_sizes[shard]}: it was made for another base model")
        pairs.setdefault((layer, site), {})[shard] = (a, b * settings.scaling)
        projections[(layer, list(TARGETS).index(module.rsplit(".", 1)[-1]))] = (
            a.contiguous(), (b * settings.scaling).t().contiguous())
    sites = {key: _pack_site(shapes[key], shards) for key, shards in pairs.items()}
    return AdapterWeights(lora_int_id, settings.rank, sites, projections)


def _site_of(name: str, module: str, shapes: dict[tuple[int, str], SiteShape]) -> tuple[int, str, int]:
    """(layer, site, shard) of an adapter module path, or LoRAError naming the module."""
    match = _MODULE.match(module)
    leaf = module.rsplit(".", 1)[-1]
    if match is None or leaf not in TARGETS:
        raise LoRAError(f"adapter {name!r}: target module {module!r} is not supported (only "
                        f"{'/'.join(TARGETS)} of the decoder layers)")
    site, shard = TARGETS[leaf]
    layer = int(match.group(1))
    if (layer, site) not in shapes:
        raise LoRAError(f"adapter {name!r}: target module {module!r} has no counterpart in the base model "
                        "(it was made for another base model)")
    return layer, site, shard


def _pack_site(shape: SiteShape, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> SiteDelta:
    """A stacked along the rank, B in its shard's output columns (module docstring)."""
    ranks = [shards[i][0].shape[0] for i in sorted(shards)]
    a_t = torch.cat([shards[i][0] for i in sorted(shards)]).t().contiguous()
    b_t = torch.zeros(sum(ranks), sum(shape.shard_sizes))
    row = 0
    for index in sorted(shards):
        a, b = shards[index]
        start = sum(shape.shard_sizes[:index])
        b_t[row : row + a.shape[0], start : start + shape.shard_sizes[index]] = b.t()
        row += a.shape[0]
    return SiteDelta(a_t, b_t)
