"""Context parallelism (training/context_parallel.py): the load-balanced chunks, and training on 4
gloo ranks (dp 2 x cp 2, and a 4-rank ring) against the single-process run (runs in ep_cp_runs.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.training.context_parallel import chunk_positions, shard_sequence

from .test_distributed import assert_losses_match


@pytest.mark.parametrize("size", [2, 4])
def test_chunks_partition_the_sequence_with_equal_causal_work(size):
    """Rank i holds chunks i and 2n-1-i: together the ranks hold every position once, and each rank's
    queries see as many keys under the causal mask (the load balance)."""
    seq = 32
    parts = [chunk_positions(seq, rank, size) for rank in range(size)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    assert {int((p + 1).sum()) for p in parts} == {seq * (seq + 1) // 2 // size}
    ids = torch.arange(seq).view(1, seq)
    assert torch.equal(shard_sequence(ids, 1, size)[0], parts[1])


REFERENCE = {"cp": "llama", "cp4": "mistral"}  # cp4: a 4-rank ring, and Mistral's sliding window


@pytest.mark.parametrize("case", ["cp", "cp4"])
def test_context_parallel_losses_equal_single_process(ep_cp_runs, case):
    for rank in ep_cp_runs["ranks"]:
        assert_losses_match(rank[case]["losses"], ep_cp_runs["reference"][REFERENCE[case]]["losses"])


@pytest.mark.parametrize("case", ["cp", "cp4"])
def test_context_parallel_gradients_equal_single_process(ep_cp_runs, case):
    """Step 1's gradients of every parameter (FSDP over dp x cp, gathered) equal one process's."""
    expected = ep_cp_runs["reference"][REFERENCE[case]]["grads"]
    for grads in ep_cp_runs["grads"][case]:
        assert set(grads) == set(expected)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case, cp", [("cp", 2), ("cp4", 4)])
def test_each_rank_saves_a_cp_th_of_the_activations(ep_cp_runs, case, cp):
    """The bytes a rank's forward keeps for backward: at most the single process's / cp (+10%), so a
    budget of the full sequence's / cp is enough for every rank and not for one process. Llama's are
    proportional (within 10% of 1/cp); one Mistral process also keeps its (seq x seq) window mask."""
    full = ep_cp_runs["reference"][REFERENCE[case]]["activation_bytes"]
    for rank in ep_cp_runs["ranks"]:
        got = rank[case]["activation_bytes"]
        assert got <= full / cp * 1.1, (got, full)
        assert case != "cp" or got >= full / cp * 0.9, (got, full)


# ---- compositions (issue 42): CP with a moe's balance loss, and CP with TP ----

COMPOSED = {"cp_moe": "moe_balanced", "cp_tp": "llama", "cp_pp": "llama", "ep_cp": "moe_balanced"}


@pytest.mark.parametrize("case", list(COMPOSED))
def test_context_parallel_compositions_equal_single_process(ep_cp_runs, case):
    """cp_moe: dp 2 x cp 2, a moe whose balance loss (coefficient 0.5) takes its routing statistics
    summed over the cp ranks; cp_tp: cp 2 x tp 2, each tp rank ringing its own heads; cp_pp: pp 2 x
    cp 2, each stage's ring within its pipeline rank's cp group; ep_cp: ep 2 x cp 2, each rank
    dispatching its chunks' tokens, experts FSDP-sharded over the data and context ranks holding them.
    Losses, and step 1's gradient of every parameter (a pipeline or EP rank holds its stage's or
    experts') equal one process's."""
    expected = ep_cp_runs["reference"][COMPOSED[case]]
    for rank in ep_cp_runs["ranks"]:
        assert_losses_match(rank[case]["losses"], expected["losses"])
    seen: set[str] = set()
    for grads in ep_cp_runs["grads"][case]:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected["grads"][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        seen |= set(grads)
    assert seen == set(expected["grads"])
