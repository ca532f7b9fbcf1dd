"""Data, tensor and sequence parallelism, applied in one place and in torchtitan's order:
tensor parallel -> activation checkpointing -> data parallel (FSDP2 / replicate).

One DeviceMesh with dims ("pp", "dp", "tp") describes the whole job; each step below is a small
function over its slice of the mesh, using only PyTorch's own APIs:

* TP: `parallelize_module` -- q/k/v/gate/up column-wise, o/down row-wise, the vocabulary sharded in the
  embedding and lm_head; with `sequence_parallel` the norms run on sequence shards (`SequenceParallel`).
* ZeRO stage 0: `replicate` (DDP on FSDP2's machinery); 1 and 2: `fully_shard(reshard_after_forward=
  False)` -- gradients and optimizer state sharded, parameters kept gathered between forward and
  backward; 3: `fully_shard(reshard_after_forward=True)` -- parameters sharded outside their layer's
  compute too. Stage 1 differs from 2 in gradient accumulation: it reduces once per step (see
  `requires_sync_every_microbatch`), stage 2 reduce-scatters every microbatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pagedllm.training.config import MemoryConfig, ParallelismConfig, Precision
from pagedllm.training.lora import LoraLinear
from pagedllm.training.lora_parallel import lora_aware
from pagedllm.training.model import TrainingCausalLM, DecoderLayer
from pagedllm.training.tied import retie

# FP8 is float8 matmuls in BF16 training (fp8.py): everything else takes BF16's policy.
LOW_PRECISION = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16, Precision.FP8: torch.bfloat16}


@dataclass(frozen=True)
class ParallelDims:
    """The job's degrees of parallelism on `world_size` processes (data_parallel_size resolved)."""

    pp: int
    dp: int
    tp: int
    ep: int = 1  # expert-parallel ranks: a split of dp (dp = dp_mod_ep x ep)
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sequence

    @classmethod
    def from_config(cls, par: ParallelismConfig) -> "ParallelDims":
        assert par.data_parallel_size is not None, "resolve() the job first"
        return cls(pp=par.pipeline_parallel_size, dp=par.data_parallel_size, tp=par.tensor_parallel_size,
                   ep=par.expert_parallel_size, cp=par.context_parallel_size)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """("pp", "dp", "tp"); with EP or CP ("pp", "dp_mod_ep", "ep", "cp", "tp"), "dp" flattened from
        dp_mod_ep x ep (the data ranks) and "dp_cp" from those x cp (what FSDP shards and reduces over:
        CP ranks hold the same parameters, as data-parallel ranks do); with both, "dp_mod_ep_cp" (the
        experts' FSDP mesh)."""
        if self.ep == self.cp == 1:
            return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        mesh = init_device_mesh(device_type, (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp_mod_ep", "ep", "cp", "tp"))
        mesh[("dp_mod_ep", "ep")]._flatten("dp")
        mesh[("dp_mod_ep", "ep", "cp")]._flatten("dp_cp")
        if self.ep > 1 and self.cp > 1:  # the ranks holding the same experts: data and context ranks
            mesh[("dp_mod_ep", "cp")]._flatten("dp_mod_ep_cp")
        return mesh

    def expert_data_parallel_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """With EP, the ranks that hold the same experts (what FSDP shards them over): the EP group's
        copies over the rest of dp, and the cp ranks (they hold the same parameters); None without EP."""
        if self.ep == 1:
            return None
        return mesh["dp_mod_ep_cp"] if self.cp > 1 else mesh["dp_mod_ep"]

    def data_parallel_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The ranks that hold copies (or FSDP shards) of the same parameters: dp, and cp with it."""
        return mesh["dp_cp"] if self.cp > 1 else mesh["dp"]


class ReplicateParallel(ParallelStyle):
    """A module whose parameters are replicated over the TP mesh and whose inputs are already
    replicated (norms when sequence parallelism is off). Turning its parameters into Replicate DTensors
    keeps every parameter of a TP model on the TP mesh, which FSDP and gradient clipping require."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._to_dtensor, output_fn=self._to_local)

    @staticmethod
    def _to_dtensor(module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    @staticmethod
    def _to_local(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output


class ReplicatedMoE(ParallelStyle):
    """A MoE block under tensor parallelism: router and experts replicated over the tp ranks (Replicate
    DTensors, computed on their local tensors: model.local_linear), its input the whole replicated
    activation (all-gathered from sequence shards with `sequence_parallel`) and its output handed back
    as the plan's next step expects (this rank's sequence shard, or the replicated tensor).

    Every tp rank routes the same tokens and runs the same experts: redundant compute, the price of
    composing with data-dependent routing (torchtitan's expert-tensor parallelism, or EP borrowing the
    tp ranks, removes it). The gradients are exact without a reduction over tp: each tp rank's are
    the same, as its inputs and output gradients are."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output_fn = self._to_sequence_shard if self.sequence_parallel else None
        return distribute_module(module, device_mesh, input_fn=self._to_replicated_local, output_fn=output_fn)

    @staticmethod
    def _to_replicated_local(module, inputs, mesh):
        """(Shard(1) or Replicate) DTensor, or an already replicated tensor -> the whole local tensor.
        to_local's backward takes the gradient as Replicate (every tp rank computed the same)."""
        return tuple(x.redistribute(mesh, [Replicate()]).to_local() if isinstance(x, DTensor) else x for x in inputs)

    @staticmethod
    def _to_sequence_shard(module, output, mesh):
        """The replicated output -> this rank's sequence shard (backward: the shards' gradients all-gathered)."""
        return DTensor.from_local(output, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    return SequenceParallel() if sequence_parallel else ReplicateParallel()


def apply_tensor_parallel(model: TrainingCausalLM, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron-style TP over `tp_mesh`; activations between blocks are sequence shards when
    `sequence_parallel`, else replicated. Works on pipeline stages too (missing parts are skipped)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    root_plan: dict[str, ParallelStyle] = {}
    if model.model.embed_tokens is not None:
        root_plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.model.norm is not None:
        root_plan["model.norm"] = _norm_style(sequence_parallel)
    if model.lm_head is not None:
        root_plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    parallelize_module(model, tp_mesh, root_plan)
    retie(model)  # the embedding and lm_head were distributed one by one: one Shard(0) DTensor again
    for layer in model.model.layers.values():
        parallelize_module(layer, tp_mesh, _layer_plan(layer, sequence_parallel))


def _layer_plan(layer: DecoderLayer, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": _norm_style(sequence_parallel),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        "post_attention_layernorm": _norm_style(sequence_parallel),
    }
    moe = hasattr(layer, "block_sparse_moe")
    if moe:
        plan["block_sparse_moe"] = ReplicatedMoE(sequence_parallel)  # gathers its own input
    else:
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                     "mlp.down_proj": RowwiseParallel(output_layouts=seq)})
    if sequence_parallel:
        for name in ("self_attn",) if moe else ("self_attn", "mlp"):
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if any(isinstance(module, LoraLinear) for module in layer.modules()):  # a LoRA fine-tune: the pairs sharded too
        plan = {name: lora_aware(style, layer.get_submodule(name)) if name.endswith("_proj") else style
                for name, style in plan.items()}
    if layer.self_attn.q_norm is not None:
        # qwen3's per-head norms see this rank's heads: a shard along the head dim (2) of (b, s, h, d).
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_activation_checkpointing(model: TrainingCausalLM, granularity: str) -> None:
    """FULL recomputes each block in backward; SELECTIVE keeps matmul outputs, recomputes the rest."""
    for layer in model.model.layers.values():
        layer.checkpointing = granularity


def data_parallel_wrapping(memory: MemoryConfig, dims: ParallelDims) -> str | None:
    """'fsdp', 'replicate' or None: ZeRO >= 1 always shards (also on one rank, so cpu_offload and
    mixed precision behave the same at any scale); stage 0 replicates only when there is a replica
    (a context-parallel rank is one: it holds the same parameters and needs the summed gradients)."""
    if memory.zero_stage >= 1:
        return "fsdp"
    # cpu_offload keeps the replicas' parameters in host memory: replicate's CPUOffloadPolicy, also on one rank
    return "replicate" if dims.dp * dims.cp > 1 or memory.cpu_offload else None


def requires_sync_every_microbatch(memory: MemoryConfig) -> bool:
    """ZeRO-2/3 reduce-scatter gradients after every microbatch (gradients stay sharded); ZeRO-0/1
    accumulate full local gradients and reduce once, on the last microbatch."""
    return memory.zero_stage >= 2


def apply_data_parallel(model: TrainingCausalLM, mem: MemoryConfig, dims: ParallelDims, dp_mesh: DeviceMesh,
                        expert_mesh: DeviceMesh | None = None) -> None:
    """`expert_mesh`: with EP, the ranks holding the same experts (training/expert_parallel.py)."""
    mp = MixedPrecisionPolicy()
    if mem.precision in LOW_PRECISION:
        mp = MixedPrecisionPolicy(param_dtype=LOW_PRECISION[mem.precision], reduce_dtype=torch.float32)
    kind = data_parallel_wrapping(mem, dims)
    host = mem.cpu_offload or mem.nvme_offload  # NVMe offload steps the optimizer in host memory too
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if host else OffloadPolicy()
    if kind == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    elif kind == "fsdp":
        options = {"mesh": dp_mesh, "mp_policy": mp, "offload_policy": offload,
                   "reshard_after_forward": mem.zero_stage == 3}
        if expert_mesh is not None:
            from pagedllm.training.expert_parallel import shard_experts

            shard_experts(model, expert_mesh, options, dims.dp * dims.cp)
        for layer in model.model.layers.values():
            fully_shard(layer, **options)
        fully_shard(model, **options)


def parallelize(model: TrainingCausalLM, par: ParallelismConfig, memory: MemoryConfig, dims: ParallelDims,
                mesh: DeviceMesh) -> TrainingCausalLM:
    """(FP8 linears ->) TP -> EP / CP -> activation checkpointing -> FSDP/replicate, each only when configured."""
    if memory.precision is Precision.FP8:
        from pagedllm.training.fp8 import apply_fp8

        apply_fp8(model, memory.fp8_recipe.value)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], par.sequence_parallel)
    if dims.ep > 1:
        from pagedllm.training.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, mesh["ep"])
    if dims.cp > 1:
        from pagedllm.training.context_parallel import apply_context_parallel

        apply_context_parallel(model, mesh["cp"])
    if memory.gradient_checkpointing:
        apply_activation_checkpointing(model, memory.activation_checkpointing_granularity.value)
    apply_data_parallel(model, memory, dims, dims.data_parallel_mesh(mesh), dims.expert_data_parallel_mesh(mesh))
    return model


def autocast_dtype(memory: MemoryConfig, dims: ParallelDims) -> torch.dtype | None:
    """Low precision without a data-parallel wrapper (whose MixedPrecisionPolicy would do it) uses autocast."""
    if memory.precision in LOW_PRECISION and data_parallel_wrapping(memory, dims) is None:
        return LOW_PRECISION[memory.precision]
    return None


def describe_sharding(model: nn.Module) -> dict[str, dict]:
    """Per parameter: global shape, local shape, mesh dims and placements -- what tests and logs show."""
    out = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            out[name] = {"shape": list(param.shape), "local_shape": list(param.to_local().shape),
                         "mesh_dims": list(param.device_mesh.mesh_dim_names or ()),
                         "placements": [repr(p) for p in param.placements]}
        else:
            out[name] = {"shape": list(param.shape), "local_shape": list(param.shape), "mesh_dims": [], "placements": []}
    return out


def reshard(parts: list[nn.Module]) -> None:
    """Free gathered parameters after a forward-only pass. Without a backward, FSDP modules that do not
    reshard after forward (ZeRO-1/2, replicate) keep the unsharded parameters registered, which the
    optimizer and the state-dict APIs do not know."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
