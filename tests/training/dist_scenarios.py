"""Run by torchrun from test_distributed.py: several tiny trainings in ONE process group (one launch
instead of one per case), each rank writing what it saw -- losses, parameter placements, local shard
shapes, whether layers were resharded after forward -- to <out>/rank<r>.json.

    torchrun --standalone --nproc-per-node N dist_scenarios.py spec.json

spec.json: {"paths": {...}, "out": dir, "scenarios": [{"name", "job", "options", "corrupt_newest": bool}]}
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pagedllm.training.checkpoint import list_checkpoints
from pagedllm.training.config import parse_job
from pagedllm.training.parallel import describe_sharding
from pagedllm.training.trainer import RunOptions, Trainer, init_distributed


def watch_resharding(trainer: Trainer) -> dict:
    """After each root forward (before backward): is the first layer's weight sharded (a DTensor) again?"""
    seen: dict = {"resharded_after_forward": []}
    part = trainer.parts[0]
    layer = next(iter(part.model.layers.values()))

    def hook(module, args, output):
        if torch.is_grad_enabled():
            weight = getattr(layer.self_attn.q_proj, "weight", None)  # QLoRA's projection keeps blocks instead
            seen["resharded_after_forward"].append(isinstance(weight, DTensor))

    part.register_forward_hook(hook)
    return seen


def offload_policy(part) -> str | None:
    """The class of the data-parallel wrapper's offload policy (FSDP's or replicate's), or None."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(part, FSDPModule):
        return None
    group = part._get_fsdp_state()._fsdp_param_group
    return type(group.offload_policy).__name__ if group is not None else None


def corrupt_newest(checkpoint_dir: Path) -> str:
    """Flip bytes in the middle of rank 1's model shard of the newest checkpoint (as disk rot would)."""
    step_dir, _ = list_checkpoints(checkpoint_dir)[-1]
    shard = step_dir / "model" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return step_dir.name


def first_step_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Gradients of step 1's loss (all microbatches), each parameter's whole tensor; with expert
    parallelism only this rank's experts (the test joins the ranks' dicts)."""
    inputs, labels = (trainer._local_sequence(t.to(trainer.device)) for t in trainer.data.step_batch(1))
    if trainer.pipeline is not None:  # this rank's stages' parameters only (the test joins the ranks' dicts)
        trainer._pipeline_forward_backward(inputs, labels)
    else:
        trainer._accumulate(inputs, labels)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for part in trainer.parts for name, p in part.named_parameters()}
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)
    return grads


def first_microbatch_activation_bytes(trainer: Trainer) -> int:
    """Bytes this rank's forward of step 1's first microbatch saves for backward."""
    from pagedllm.training.activation_memory import saved_activation_bytes

    inputs, labels = (trainer._local_sequence(t.to(trainer.device)) for t in trainer.data.step_batch(1))
    micro = trainer.job.data.micro_batch_size
    part = trainer.parts[0]
    return saved_activation_bytes(part, lambda: part(inputs[:micro]))


def measure_before_training(trainer: Trainer, spec: dict) -> dict:
    """Optional, before the run (neither changes the parameters): the bytes step 1's first
    microbatch saves for backward ("activations"), step 1's gradients saved to <"gradients">/."""
    measured = {}
    if spec.get("activations"):
        measured["activation_bytes"] = first_microbatch_activation_bytes(trainer)
    if spec.get("gradients"):
        grads = first_step_gradients(trainer)
        torch.save(grads, Path(spec["gradients"]) / f"{spec['name']}-grads-rank{dist.get_rank()}.pt")
    return measured


def run_scenario(spec: dict) -> dict:
    if spec.get("corrupt_newest"):
        if dist.get_rank() == 0:
            corrupt_newest(Path(spec["job"]["checkpoint_config"]["checkpoint_dir"]))
        dist.barrier()
    trainer = Trainer(parse_job(spec["job"]), RunOptions(**spec.get("options", {})))
    measured = measure_before_training(trainer, spec)
    seen = watch_resharding(trainer)
    result = trainer.run()
    optimizer_state = {name: list(state["exp_avg"].to_local().shape if isinstance(state["exp_avg"], DTensor)
                                  else state["exp_avg"].shape)
                       for part, opt in zip(trainer.parts, trainer.optimizers)
                       for name, p in part.named_parameters()
                       if (state := opt.state.get(p)) and isinstance(state.get("exp_avg"), torch.Tensor)}  # not nvme_offload's
    pipeline = trainer.pipeline
    return {
        "offload_policy": offload_policy(trainer.parts[0]),
        **measured,
        "losses": {str(k): v for k, v in result.losses.items()},
        "val_loss": result.val_loss,
        "start_step": result.start_step,
        "reason": result.reason,
        "sharding": {k: v for part in trainer.parts for k, v in describe_sharding(part).items()},
        "exp_avg_local_shapes": optimizer_state,
        **seen,
        "pipeline": None if pipeline is None else {
            "schedule": type(pipeline.schedule).__name__, "microbatches": pipeline.microbatches,
            "stages": pipeline.stage_indices, "num_stages": pipeline.num_stages},
    }


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    init_distributed()
    results = {scenario["name"]: run_scenario(scenario) for scenario in spec["scenarios"]}
    out = Path(spec["out"])
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
