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


def test_the_one_machine_recipe_is_runnable_as_written():
    """docs/jobs.md's "Ray on one machine" block, which scripts/ray_one_machine.sh runs (about two
    minutes: not in `make test`): the block is where the script looks for it, its job file is a
    valid TrainingJob for 2 ranks, and its commands are the ones the script rewrites (port, stop)."""
    import re
    from pathlib import Path

    from pagedllm.training.config import load_job

    root = Path(__file__).resolve().parents[2]
    block = re.search(r"<!-- ray-one-machine[^>]*-->\n```bash\n(.*?)```", (root / "docs/jobs.md").read_text(), re.S).group(1)
    assert "--data-binary @configs/ray-one-machine.toml" in block and "--port 8000" in block
    assert block.rstrip().endswith("kill %1; ray stop")
    assert (root / "scripts/ray_one_machine.sh").stat().st_mode & 0o111
    job = load_job(root / "configs/ray-one-machine.toml")
    assert job.parallelism.data_parallel_size == 2 and job.optimization.total_steps == 20
