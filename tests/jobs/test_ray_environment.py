"""torch.distributed's environment for a job's ranks on Ray nodes (no cluster needed)."""
from __future__ import annotations

from pagedllm.jobs.ray_cluster import rank_environments, ray_address

import pytest


def test_ranks_rendezvous_at_rank_0_and_count_locally_per_node():
    where = [{"node_id": "a", "address": "10.0.0.1", "gpu_ids": ["2"]}, {"node_id": "a", "address": "10.0.0.1", "gpu_ids": ["0"]},
             {"node_id": "b", "address": "10.0.0.2", "gpu_ids": ["1"]}]
    envs = rank_environments(where, 29511, {"PAGEDLLM_JOB_ID": "j"})
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "29511")}
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [("0", "2", "0"), ("1", "2", "0"), ("0", "1", "1")]
    # each rank sees its node's job GPUs, LOCAL_RANK indexing its own
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2,0", "2,0", "1"]
    assert all(e["PAGEDLLM_JOB_ID"] == "j" for e in envs)
    cpu = rank_environments([{"node_id": "a", "address": "127.0.0.1", "gpu_ids": []}], 1, {})
    assert "CUDA_VISIBLE_DEVICES" not in cpu[0]


def test_cluster_flag():
    assert ray_address("ray") == "auto"
    assert ray_address("ray://head:10001") == "ray://head:10001"
    for bad in ("ray://", "yarn", "head:6379"):
        with pytest.raises(ValueError, match="--cluster"):
            ray_address(bad)
