"""The runs behind test_expert_parallel.py and test_context_parallel.py: one 4-rank torchrun launch
(dist_scenarios.py) holding every case, and the single-process runs in this process.

    ep:  moe, dp 4 = dp_mod_ep 2 x ep 2, ZeRO-3 (EP composed with FSDP); stopped at step 3 and resumed
    cp:  llama, dp 2 x cp 2, ZeRO-3;  cp4: mistral with a sliding window of 8, cp 4 (a 4-rank ring),
         ZeRO-0 (replicate over the cp ranks, dp = 1)
    compositions (issue 42): moe_tp: moe, dp 2 x tp 2 with sequence parallelism, ZeRO-3;
         ep_tp: moe, ep 2 x tp 2 (dp 2 = ep), ZeRO-3;  cp_moe: moe with a 0.5 balance loss, dp 2 x cp 2;
         cp_tp: llama, cp 2 x tp 2 (dp 1), ZeRO-3 over the cp ranks;  cp_pp: llama, pp 2 x cp 2 (dp 1);
         ep_cp, ep_pp: moe with a 0.5 balance loss, ep 2 x cp 2 and ep 2 x pp 2 (dp 2 = ep)
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, Trainer, init_distributed

from .dist_scenarios import first_microbatch_activation_bytes, first_step_gradients
from .helpers import tiny_job
from .test_distributed import FAST, launch_scenarios

MOE = {"architecture": "moe", "num_experts": 4, "num_experts_per_token": 2}
EP = {"expert_parallel_size": 2}
CP = {"context_parallel_size": 2}
CP4 = {"context_parallel_size": 4}
MISTRAL = {"architecture": "mistral", "sliding_window": 8}  # the window inside the 32-token sequence
MOE_BALANCED = {**MOE, "router_aux_loss_coef": 0.5}  # a balance loss large enough to move the gradients
TP = {"tensor_parallel_size": 2}
# the compositions: (name, sections, the one-process reference's name)
COMPOSITIONS = {
    "moe_tp": ({"model_config": MOE, "parallelism_config": {**TP, "sequence_parallel": True}}, "moe"),
    "ep_tp": ({"model_config": MOE, "parallelism_config": {**TP, **EP}}, "moe"),
    "cp_moe": ({"model_config": MOE_BALANCED, "parallelism_config": CP}, "moe_balanced"),
    "cp_tp": ({"parallelism_config": {**TP, **CP}}, "llama"),
    "cp_pp": ({"parallelism_config": {"pipeline_parallel_size": 2, **CP}}, "llama"),
    "ep_cp": ({"model_config": MOE_BALANCED, "parallelism_config": {**EP, **CP}}, "moe_balanced"),
    "ep_pp": ({"model_config": MOE_BALANCED, "parallelism_config": {**EP, "pipeline_parallel_size": 2}}, "moe_balanced"),
}


def in_process(paths: dict, checkpoint_dir: Path, **sections) -> dict:
    """The one-process, unwrapped (ZeRO-0) run of the tiny job: step 1's gradients, the bytes its
    first microbatch saves for backward, then the training's losses."""
    sections.setdefault("memory_config", {"zero_stage": 0})
    created = init_distributed()
    try:
        trainer = Trainer(parse_job(tiny_job(paths, checkpoint_dir, **sections)), RunOptions(**FAST))
        measured = {"grads": first_step_gradients(trainer), "activation_bytes": first_microbatch_activation_bytes(trainer)}
        return {**measured, "losses": {str(k): v for k, v in trainer.run().losses.items()}}
    finally:
        if created:
            dist.destroy_process_group()


def run_all(paths: dict, root: Path) -> dict:
    """Each distributed case measures its step-1 gradients (and, for CP, activation bytes) before training."""
    out = root / "out"
    out.mkdir(parents=True)
    measure = {"gradients": str(out), "activations": True}

    def case(name: str, **sections) -> dict:
        return {"name": name, "job": tiny_job(paths, root / name, **sections), "options": FAST, **measure}

    ep = {"model_config": MOE, "parallelism_config": EP}
    resumed = {"name": "ep_resume", "job": tiny_job(paths, root / "ep_stop", **ep), "options": FAST}
    stopped = {**resumed, "name": "ep_stop", "options": {**FAST, "stop_at_step": 3}}
    scenarios = [case("ep", **ep), stopped, resumed, case("cp", parallelism_config=CP), case("cp4", model_config=MISTRAL, parallelism_config=CP4, memory_config={"zero_stage": 0})]
    scenarios += [{**case(name, **sections), "activations": False} for name, (sections, _) in COMPOSITIONS.items()]
    ranks = launch_scenarios(4, scenarios, paths, out)
    grads = {name: [torch.load(out / f"{name}-grads-rank{r}.pt") for r in range(4)] for name in ("ep", "cp", "cp4", *COMPOSITIONS)}
    ref = root / "reference"
    return {"ranks": ranks, "grads": grads,
            "reference": {"moe": in_process(paths, ref / "moe", model_config=MOE), "llama": in_process(paths, ref / "llama"),
                          "mistral": in_process(paths, ref / "mistral", model_config=MISTRAL),
                          "moe_balanced": in_process(paths, ref / "moe_balanced", model_config=MOE_BALANCED)}}
