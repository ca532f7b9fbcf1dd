"""Expert parallelism (training/expert_parallel.py) against the single-process run: 4 gloo ranks,
dp 4 = dp_mod_ep 2 x ep 2 with ZeRO-3, a 4-expert top-2 moe (runs in ep_cp_runs.py)."""
from __future__ import annotations

import pytest
import torch

from .test_distributed import assert_losses_match


def test_expert_parallel_losses_equal_single_process(ep_cp_runs):
    for rank in ep_cp_runs["ranks"]:
        assert_losses_match(rank["ep"]["losses"], ep_cp_runs["reference"]["moe"]["losses"])


def test_expert_parallel_gradients_equal_single_process(ep_cp_runs):
    """Step 1's gradients, every parameter: the dense ones on every rank, each expert's on the ranks
    holding it -- all equal to one process's over the same global batch (fp32 tolerance)."""
    expected = ep_cp_runs["reference"]["moe"]["grads"]
    seen: set[str] = set()
    for grads in ep_cp_runs["grads"]["ep"]:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        seen |= set(grads)
    assert seen == set(expected)


@pytest.mark.parametrize("rank", range(4))
def test_each_rank_holds_its_experts_sharded_over_the_rest_of_dp(ep_cp_runs, rank):
    """Mesh (dp_mod_ep 2, ep 2): rank r is EP rank r % 2 and holds experts 2(r % 2) and 2(r % 2) + 1,
    FSDP-sharded (dim 0 halves) over the two ranks holding the same experts; the rest over all 4."""
    sharding = ep_cp_runs["ranks"][rank]["ep"]["sharding"]
    mine = {2 * (rank % 2), 2 * (rank % 2) + 1}
    layer = "model.layers.0.block_sparse_moe."
    held = {int(name[len(layer + "experts."):].split(".")[0]) for name in sharding if name.startswith(layer + "experts.")}
    assert held == mine
    w1 = sharding[f"{layer}experts.{min(mine)}.w1.weight"]
    assert w1["mesh_dims"] == ["dp_mod_ep"] and w1["placements"] == ["Shard(dim=0)"]
    assert w1["local_shape"] == [w1["shape"][0] // 2, w1["shape"][1]]
    gate = sharding[f"{layer}gate.weight"]
    assert gate["mesh_dims"] == ["dp"] and gate["local_shape"] == [gate["shape"][0] // 4, gate["shape"][1]]


def test_expert_parallel_resume_reproduces_the_uninterrupted_run(ep_cp_runs):
    """Each rank's experts go into the DCP checkpoint under their global names and come back."""
    for rank in ep_cp_runs["ranks"]:
        stopped, resumed, whole = rank["ep_stop"], rank["ep_resume"], rank["ep"]
        assert stopped["reason"] == "stopped" and list(stopped["losses"]) == ["1", "2", "3"]
        assert resumed["start_step"] == 3 and resumed["losses"] == {k: v for k, v in whole["losses"].items() if int(k) > 3}


# ---- compositions (issue 42): a moe under tensor parallelism, and EP with TP ----

def assert_gradients_equal(grads_per_rank: list[dict], expected: dict) -> None:
    """Every parameter's step-1 gradient on every rank holding it equals one process's; together the
    ranks hold every parameter."""
    seen: set[str] = set()
    for grads in grads_per_rank:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        seen |= set(grads)
    assert seen == set(expected)


@pytest.mark.parametrize("case", ["moe_tp", "ep_tp"])
def test_moe_under_tensor_parallelism_equals_single_process(ep_cp_runs, case):
    """moe_tp: dp 2 x tp 2 with sequence parallelism, experts replicated over tp; ep_tp: ep 2 x tp 2,
    each tp index's copy of the MoE dispatching over its own EP group. Losses and step 1's gradients
    (the tp-replicated experts' are not reduced over tp: a sum there would double them)."""
    for rank in ep_cp_runs["ranks"]:
        assert_losses_match(rank[case]["losses"], ep_cp_runs["reference"]["moe"]["losses"])
    assert_gradients_equal(ep_cp_runs["grads"][case], ep_cp_runs["reference"]["moe"]["grads"])


@pytest.mark.parametrize("rank", range(4))
def test_moe_under_tensor_parallelism_places_experts_off_the_tp_dimension(ep_cp_runs, rank):
    """Attention stays tp-sharded; router and experts are Replicate over tp. Without EP they are
    FSDP-sharded over dp; with EP (mesh dp_mod_ep 1 x ep 2 x tp 2) rank r is EP rank r // 2 and holds
    experts 2(r // 2), 2(r // 2) + 1 on (dp_mod_ep, tp): neither the FSDP nor the EP mesh includes tp."""
    layer = "model.layers.0."
    moe_tp = ep_cp_runs["ranks"][rank]["moe_tp"]["sharding"]
    q = moe_tp[layer + "self_attn.q_proj.weight"]
    assert q["mesh_dims"] == ["dp", "tp"] and q["placements"][1] == "Shard(dim=0)"
    for name in (layer + "block_sparse_moe.gate.weight", layer + "block_sparse_moe.experts.3.w1.weight"):
        assert moe_tp[name]["mesh_dims"] == ["dp", "tp"] and moe_tp[name]["placements"] == ["Shard(dim=0)", "Replicate()"]
    ep_tp = ep_cp_runs["ranks"][rank]["ep_tp"]["sharding"]
    experts = layer + "block_sparse_moe.experts."
    mine = {2 * (rank // 2), 2 * (rank // 2) + 1}
    assert {int(name[len(experts):].split(".")[0]) for name in ep_tp if name.startswith(experts)} == mine
    w1 = ep_tp[f"{experts}{min(mine)}.w1.weight"]
    assert w1["mesh_dims"] == ["dp_mod_ep", "tp"] and w1["placements"][1] == "Replicate()"


def test_expert_parallel_with_pipeline_equals_single_process(ep_cp_runs):
    """ep_pp: ep 2 x pp 2 (dp 2 = ep), balance loss 0.5: each stage's MoE layers dispatch over the EP
    group of their pipeline rank (same schedule, so the all-to-alls pair up), and moe_pipeline.py hands
    the first stage's balance losses their gradient. Losses, and every parameter's step-1 gradient on
    the ranks holding it (a stage's layers, an EP rank's experts)."""
    expected = ep_cp_runs["reference"]["moe_balanced"]
    for rank in ep_cp_runs["ranks"]:
        assert_losses_match(rank["ep_pp"]["losses"], expected["losses"])
    assert_gradients_equal(ep_cp_runs["grads"]["ep_pp"], expected["grads"])
