"""The runs behind test_expert_parallel.py and test_context_parallel.py: one 4-rank torchrun launch
(dist_scenarios.py) holding every case, and the single-process runs in this process.

    ep:  moe, dp 4 = dp_mod_ep 2 x ep 2, ZeRO-3 (EP composed with FSDP)
    cp:  llama, dp 2 x cp 2, ZeRO-3;  cp4: llama, cp 4 (a 4-rank ring)
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, Trainer, init_distributed

from .dist_scenarios import first_microbatch_activation_bytes, first_step_gradients
from .helpers import tiny_job
from .test_distributed import FAST, launch_scenarios, reference_losses

MOE = {"architecture": "moe", "num_experts": 4, "num_experts_per_token": 2}
EP = {"expert_parallel_size": 2}
CP = {"context_parallel_size": 2}
CP4 = {"context_parallel_size": 4}


def in_process(paths: dict, checkpoint_dir: Path, measure, **sections):
    """`measure(trainer)` on a one-process, unwrapped (ZeRO-0) trainer of the tiny job."""
    sections.setdefault("memory_config", {"zero_stage": 0})
    created = init_distributed()
    try:
        return measure(Trainer(parse_job(tiny_job(paths, checkpoint_dir, **sections)), RunOptions(**FAST)))
    finally:
        if created:
            dist.destroy_process_group()


def run_all(paths: dict, root: Path) -> dict:
    out = root / "out"
    out.mkdir(parents=True)

    def case(name: str, **extra) -> dict:
        sections = {k: v for k, v in extra.items() if k.endswith("_config")}
        flags = {k: (str(out) if k == "gradients" else v) for k, v in extra.items() if not k.endswith("_config")}
        return {"name": name, "job": tiny_job(paths, root / name, **sections), "options": FAST, **flags}

    ep = {"model_config": MOE, "parallelism_config": EP}
    scenarios = [case("ep", **ep), case("ep_grads", gradients=True, **ep),
                 case("cp", parallelism_config=CP), case("cp_grads", gradients=True, parallelism_config=CP),
                 case("cp_act", activations=True, parallelism_config=CP),
                 case("cp4", parallelism_config=CP4), case("cp4_act", activations=True, parallelism_config=CP4)]
    ranks = launch_scenarios(4, scenarios, paths, out)
    grads = {name: [torch.load(out / f"{name}-grads-rank{r}.pt") for r in range(4)] for name in ("ep_grads", "cp_grads")}
    ref = root / "reference"
    return {
        "ranks": ranks, "grads": grads,
        "reference": {
            "moe": reference_losses(paths, ref / "moe", model_config=MOE),
            "llama": reference_losses(paths, ref / "llama"),
            "moe_grads": in_process(paths, ref / "moe_g", first_step_gradients, model_config=MOE),
            "llama_grads": in_process(paths, ref / "llama_g", first_step_gradients),
            "llama_activation_bytes": in_process(paths, ref / "llama_a", first_microbatch_activation_bytes),
        },
    }
