"""Pipeline parallelism with torch.distributed.pipelining: stages cut from the model's layers.

Each pipeline rank keeps a copy of the model pruned to its stage's layers (embed_tokens on the first
stage, norm and lm_head on the last); layer names keep their global index, so the stages' checkpoint
shards form one model. A stage is then parallelised like a whole model (TP -> AC -> FSDP on its own
layers) and handed to a PipelineStage. Schedule1F1B is the default (one forward, one backward: warm-up
forwards, one-forward-one-backward steady state, cool-down backwards); ScheduleGPipe and
ScheduleInterleaved1F1B (several "virtual" stages per rank, assigned round-robin) are selectable.
The schedule splits each rank's batch into global_batch / (micro_batch_size x dp) microbatches and,
with scale_grads, averages their gradients -- so a step equals the unpipelined step.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from pagedllm.training.config import MemoryConfig, ParallelismConfig, PipelineSchedule
from pagedllm.training.model import TrainingCausalLM
from pagedllm.training.parallel import ParallelDims, parallelize
from pagedllm.training.tied import TiedStageGradients

SINGLE_STAGE_SCHEDULES = {PipelineSchedule.ONE_F_ONE_B: Schedule1F1B, PipelineSchedule.GPIPE: ScheduleGPipe}


def layer_split(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible layer ranges; earlier stages take the remainder."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_module(model: TrainingCausalLM, stage_index: int, num_stages: int) -> TrainingCausalLM:
    """A copy of `model` holding only stage `stage_index`'s part."""
    part = copy.deepcopy(model)
    keep = layer_split(model.cfg.num_layers, num_stages)[stage_index]
    for name in list(part.model.layers.keys()):
        if int(name) not in keep:
            del part.model.layers[name]
    if stage_index != 0:
        part.model.embed_tokens = None
    if stage_index != num_stages - 1:
        part.model.norm = None
        part.lm_head = None
    return part


@dataclass
class Pipeline:
    schedule: object
    parts: list[TrainingCausalLM]
    stage_indices: list[int]
    num_stages: int
    microbatches: int
    tied: TiedStageGradients | None = None  # a tied embedding's first/last-stage copies

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices


def build_pipeline(model: TrainingCausalLM, par: ParallelismConfig, memory: MemoryConfig, microbatches: int,
                   dims: ParallelDims, mesh: DeviceMesh, device: torch.device, loss_fn: Callable) -> Pipeline:
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    per_rank = par.resolved_stages_per_rank
    num_stages = dims.pp * per_rank
    stage_indices = [pp_rank + i * dims.pp for i in range(per_rank)]
    parts, stages = [], []
    for index in stage_indices:
        part = parallelize(stage_module(model, index, num_stages), par, memory, dims, mesh)
        parts.append(part)
        stages.append(PipelineStage(part, index, num_stages, device, group=pp_mesh.get_group()))
    if par.pipeline_schedule is PipelineSchedule.INTERLEAVED_1F1B:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        schedule = SINGLE_STAGE_SCHEDULES[par.pipeline_schedule](stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    tied = TiedStageGradients.build(parts, stage_indices, num_stages, mesh) if model.cfg.tie_word_embeddings else None
    return Pipeline(schedule, parts, stage_indices, num_stages, microbatches, tied)
