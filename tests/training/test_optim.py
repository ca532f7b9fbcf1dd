"""LAMB against its update formula (computed independently in numpy), and the learning-rate schedules."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.training.config import OptimizationConfig
from pagedllm.training.optim import LAMB, build_optimizer, lr_at


def lamb_reference(w, grads, lr, beta1, beta2, eps, wd):
    """You et al. 2019, Algorithm 2 with Adam's bias correction, one tensor, float64."""
    w = w.astype(np.float64).copy()
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        r = m_hat / (np.sqrt(v_hat) + eps) + wd * w
        w_norm, r_norm = np.linalg.norm(w), np.linalg.norm(r)
        trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
        w = w - lr * trust * r
    return w


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_matches_its_formula(wd):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 7))
    grads = [rng.normal(size=(5, 7)) for _ in range(4)]
    param = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = LAMB([param], lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd)
    for g in grads:
        param.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    expected = lamb_reference(w0, grads, 0.01, 0.9, 0.99, 1e-6, wd)
    np.testing.assert_allclose(param.detach().numpy(), expected, rtol=1e-12, atol=1e-14)


def test_lamb_trust_ratio_is_one_for_zero_weights():
    """||w|| = 0 (e.g. a zero-initialised tensor): the step is plain Adam's, not 0 or NaN."""
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = LAMB([param], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    param.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt.step()
    # first Adam step: m_hat = g, v_hat = g^2 -> update = sign(g) (up to eps)
    np.testing.assert_allclose(param.detach().numpy(), -0.1 * np.sign([1.0, -2.0, 0.5]), rtol=1e-6)


def test_lamb_per_tensor_trust_ratio_differs_from_adam():
    """Two tensors with very different norms take steps scaled by their own ||w||."""
    big = torch.nn.Parameter(torch.full((4,), 10.0))
    small = torch.nn.Parameter(torch.full((4,), 0.1))
    opt = LAMB([big, small], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    big.grad = small.grad = torch.ones(4)
    opt.step()
    assert (10.0 - big.detach()).mean() / (0.1 - small.detach()).mean() == pytest.approx(100.0, rel=1e-4)


def test_build_optimizer_decays_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=True))
    cfg = OptimizationConfig(optimizer="LAMB", weight_decay=0.3)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, LAMB)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.3 for p in g["params"]}
    assert decay == {id(model[0].weight)}
    assert isinstance(build_optimizer(model, OptimizationConfig(optimizer="ADAMW")), torch.optim.AdamW)
    assert type(build_optimizer(model, OptimizationConfig(optimizer="ADAM"))) is torch.optim.Adam


def test_adamw_on_plain_cpu_tensors_is_fused_and_steps_like_the_loop():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    fused = build_optimizer(model, OptimizationConfig(optimizer="ADAMW", learning_rate=1e-2, weight_decay=0.1))
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW([{"params": [p.detach().clone().requires_grad_() for p in g["params"]], "weight_decay": g["weight_decay"]}
                              for g in fused.param_groups], lr=1e-2, betas=fused.defaults["betas"], eps=fused.defaults["eps"],
                             foreach=False)
    pairs = [(a, b) for ga, gb in zip(fused.param_groups, loop.param_groups) for a, b in zip(ga["params"], gb["params"])]
    for _ in range(3):
        for a, b in pairs:
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for a, b in pairs:
        torch.testing.assert_close(a, b)


def test_schedules():
    base = dict(learning_rate=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    cosine = OptimizationConfig(lr_scheduler="COSINE", **base)
    linear = OptimizationConfig(lr_scheduler="LINEAR", **base)
    constant = OptimizationConfig(lr_scheduler="CONSTANT", **base)
    for cfg in (cosine, linear, constant):
        assert lr_at(1, cfg) == pytest.approx(0.1) and lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, cosine) == pytest.approx(0.1) and lr_at(500, cosine) == pytest.approx(0.1)
    assert lr_at(60, linear) == pytest.approx(0.55) and lr_at(110, linear) == pytest.approx(0.1)
    assert lr_at(110, constant) == 1.0
    lrs = [lr_at(s, cosine) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
