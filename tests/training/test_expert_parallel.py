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
