"""Optimizers and the learning-rate schedule.

ADAM and ADAMW are torch's. LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") is
ours: Adam's bias-corrected update plus decoupled weight decay, scaled per parameter tensor by the
trust ratio ||w|| / ||update||. The norms are of the whole tensor: on FSDP/TP shards (DTensors) torch's
norm reduces over the mesh, so a sharded run takes the same step as a single process.

The schedule is a pure function of the step (warmup, then COSINE / LINEAR decay to min_lr_ratio, or
CONSTANT); the trainer sets each group's lr before every step, so there is no scheduler state to save.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.training.config import LRScheduler, OptimizationConfig, Optimizer


class LAMB(torch.optim.Optimizer):
    """w <- w - lr * r * u, with u = m_hat / (sqrt(v_hat) + eps) + wd * w and r = ||w|| / ||u||
    (r = 1 when either norm is zero), m and v Adam's moments with bias correction."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        if lr <= 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"LAMB: invalid hyper-parameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"].item()
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1**step)
                v_hat = state["exp_avg_sq"] / (1 - beta2**step)
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = _full_norm(p), _full_norm(update)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.sub_(update * (group["lr"] * trust))
        return loss


def _full_norm(t: torch.Tensor) -> torch.Tensor:
    """The norm of the whole tensor as a plain scalar tensor, also when `t` is a DTensor shard."""
    norm = torch.linalg.vector_norm(t)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def param_groups(parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms (1-D) are not decayed."""
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # a LoRA job has no 1-D parameter; DCP cannot flatten an empty group


def fusable(groups: list[dict]) -> bool:
    """torch's fused Adam/AdamW kernel applies: plain float tensors on a CPU or CUDA device. It takes
    a parameter's whole update in one pass over its four tensors, where the per-tensor loop (torch's
    default on a CPU) makes a dozen passes and temporaries as large as the parameter: 0.06 s instead
    of 0.22-0.44 s a step for SmolLM2-135M on one core. DTensor shards (FSDP, TP) keep the default."""
    from torch.distributed.tensor import DTensor

    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(not isinstance(p, DTensor) and p.dtype.is_floating_point and p.device.type in ("cpu", "cuda")
                                for p in params)


def build_optimizer(part: nn.Module, cfg: OptimizationConfig) -> torch.optim.Optimizer:
    groups = param_groups([part], cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer is Optimizer.LAMB:
        return LAMB(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.epsilon)
    fused = {"fused": True} if fusable(groups) else {}
    if cfg.optimizer is Optimizer.ADAM:
        # torch's Adam folds weight decay into the gradient (L2), as in the original paper.
        return torch.optim.Adam(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.epsilon, **fused)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.epsilon, **fused)


def lr_at(step: int, cfg: OptimizationConfig) -> float:
    """Learning rate of 1-based `step`: linear warmup to learning_rate, then the configured decay."""
    peak = cfg.learning_rate
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    if cfg.lr_scheduler is LRScheduler.CONSTANT:
        return peak
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = peak * cfg.min_lr_ratio
    if cfg.lr_scheduler is LRScheduler.LINEAR:
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


def clip_grad_norm(parts: list[nn.Module], max_norm: float, pp_group=None, ep_group=None) -> float:
    """Global L2 norm of all gradients (across FSDP/TP shards via DTensor, across pipeline stages
    via one all-reduce of the squared norm, across expert-parallel ranks' experts likewise),
    clipped to `max_norm` when it is > 0."""
    import torch.distributed as dist

    from pagedllm.training.tied import is_duplicate

    params = [p for part in parts for p in part.parameters() if p.grad is not None]
    duplicates = [p for p in params if is_duplicate(p)]  # a tied weight's second pipeline copy: counted once,
    params = [p for p in params if not is_duplicate(p)]  # clipped like the first
    groups = [params]
    if ep_group is not None:  # experts live on one EP rank (and on their own FSDP mesh)
        from pagedllm.training.expert_parallel import expert_parameters

        experts = expert_parameters(parts)
        groups = [[p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]]
    if ep_group is None:
        norm = _norm(params)
    else:
        dense, expert = (_norm(group) ** 2 for group in groups)
        dist.all_reduce(expert, group=ep_group)
        norm = (dense + expert).sqrt()
    if pp_group is not None:
        squared = norm ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0:
        for group in (*groups, duplicates):
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return float(norm)


def _norm(params: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of these parameters' gradients as a plain fp32 scalar (DTensor shards reduced)."""
    if not params:
        return torch.zeros((), device=torch.get_default_device())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float()
