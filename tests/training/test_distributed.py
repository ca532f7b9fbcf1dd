"""Acceptance: real multi-process training with gloo (no mocks of torch.distributed).

Each torchrun launch costs ~15 s on 2 cores, so one 2-rank launch runs every 2-rank case in one process
group (dist_scenarios.py) and one 4-rank launch runs FSDP x TP; the single-process references run
in-process here. Losses must equal the single-process run on the same global batch (fp32, 1e-4
relative), parameters must be sharded as the stage says, and resumed runs must reproduce the
uninterrupted run's losses exactly.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.adapters.peft_format import load_adapter
from pagedllm.training.config import parse_job
from pagedllm.training.progress import read_metrics
from pagedllm.training.trainer import RunOptions, run_training

from gguf_files import write_gguf
from tiny_models import build_model, load_reference

from .helpers import lora_job, tiny_job, write_chat

HERE = Path(__file__).parent
FAST = {"peak_flops": 1e10, "export_hf": False}
EXPORT = {"peak_flops": 1e10}  # and the final Hugging Face / PEFT folder
QWEN3 = {"architecture": "qwen3", "head_dim": 16}
MOE = {"architecture": "moe", "num_experts": 4, "num_experts_per_token": 2}
TIED = {"tie_word_embeddings": True}  # as SmolLM2, the default served model
MOE_BALANCED = {**MOE, "router_aux_loss_coef": 0.5}  # a balance loss large enough to move the losses


def launch_scenarios(nproc: int, scenarios: list[dict], paths: dict, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"paths": {k: str(v) for k, v in paths.items()}, "out": str(out), "scenarios": scenarios}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "dist_scenarios.py"), str(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def reference_losses(paths: dict, checkpoint_dir: Path, **sections) -> dict[str, float]:
    """One process, no parallelism wrappers: the run every distributed case must equal."""
    sections.setdefault("memory_config", {"zero_stage": 0})
    result = run_training(parse_job(tiny_job(paths, checkpoint_dir, **sections)), RunOptions(**FAST))
    return {str(k): v for k, v in result.losses.items()}


@pytest.fixture(scope="module")
def references(tiny_paths, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("references")
    return {"llama": reference_losses(tiny_paths, root / "llama"),
            "qwen3": reference_losses(tiny_paths, root / "qwen3", model_config=QWEN3),
            "moe": reference_losses(tiny_paths, root / "moe", model_config=MOE),
            "llama4": reference_losses(tiny_paths, root / "llama4", model_config={"num_layers": 4}),
            "tied": reference_losses(tiny_paths, root / "tied", model_config=TIED),
            "tied_grad_norms": grad_norms(root / "tied"),
            "fp8": reference_losses(tiny_paths, root / "fp8", memory_config={"zero_stage": 0, "precision": "FP8"}),
            "fp16": reference_losses(tiny_paths, root / "fp16", memory_config={"zero_stage": 3, "precision": "FP16"}),
            "moe_balanced": reference_losses(tiny_paths, root / "moe_balanced", model_config=MOE_BALANCED),
            "moe_balanced_grad_norms": grad_norms(root / "moe_balanced")}


def grad_norms(checkpoint_dir: Path) -> list[float]:
    return [record["grad_norm"] for record in read_metrics(checkpoint_dir / "metrics.jsonl")]


def ft_base(root: Path, gguf: bool = False) -> Path:
    """The tiny pretrained (tied-embedding) base and its chat data, made once under `root`; with
    `gguf`, the same weights as an F32 GGUF file (a fine-tune from it equals one from the folder)."""
    if not (root / "ft-base").is_dir():
        build_model(root / "ft-base", "llama", tie_word_embeddings=True)
        write_chat(root / "chat.jsonl")
    if gguf and not (root / "ft-base.gguf").is_file():
        write_gguf(root / "ft-base", root / "ft-base.gguf")
    return root / "ft-base.gguf" if gguf else root / "ft-base"


def finetune_job(root: Path, name: str, zero_stage: int, method: str = "lora", gguf: bool = False, **sections) -> dict:
    """A LoRA (or full) fine-tune of a tiny pretrained (tied-embedding) base on chat data, without dropout
    (each rank draws its own dropout masks, so only the deterministic update can equal one process's)."""
    base = ft_base(root, gguf)
    job = lora_job(base, root / "chat.jsonl", root / name, steps=4, memory_config={"zero_stage": zero_stage},
                   **sections)
    job["finetune_config"].update(lora_dropout=0.0, method=method)
    if method == "full":
        job["optimization_config"]["learning_rate"] = 1e-3
    return job


@pytest.fixture(scope="module")
def two_ranks(tiny_paths, tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("two-ranks")

    def case(name: str, ckpt: str | None = None, options: dict | None = None, **sections) -> dict:
        return {"name": name, "job": tiny_job(tiny_paths, root / (ckpt or name), **sections),
                "options": {**FAST, **(options or {})}}

    pp = {"pipeline_parallel_size": 2}
    scenarios = [
        case("zero0", memory_config={"zero_stage": 0}),
        case("zero1", memory_config={"zero_stage": 1}),
        case("zero2", memory_config={"zero_stage": 2}),
        case("zero3", "z3", memory_config={"zero_stage": 3}, checkpoint_config={"checkpoint_interval_steps": 2}),
        {**case("zero3_corrupt", "z3", memory_config={"zero_stage": 3}), "corrupt_newest": True},
        case("zero3_stop", "z3s", {"stop_at_step": 3}, memory_config={"zero_stage": 3}),
        case("zero3_resume", "z3s", memory_config={"zero_stage": 3}),
        case("pp", parallelism_config=pp),
        case("pp_stop", "pps", {"stop_at_step": 3}, parallelism_config=pp),
        case("pp_resume", "pps", parallelism_config=pp),
        case("tp", parallelism_config={"tensor_parallel_size": 2}, memory_config={"zero_stage": 0}),
        case("tp_qwen3_sp", parallelism_config={"tensor_parallel_size": 2, "sequence_parallel": True},
             model_config=QWEN3, memory_config={"zero_stage": 0}),
        case("moe_zero3", model_config=MOE, memory_config={"zero_stage": 3}),
        case("pp_gpipe", parallelism_config={**pp, "pipeline_schedule": "GPIPE"}),
        case("pp_interleaved", parallelism_config={**pp, "pipeline_schedule": "INTERLEAVED_1F1B"},
             model_config={"num_layers": 4}),
        case("tp_tied", parallelism_config={"tensor_parallel_size": 2}, model_config=TIED, memory_config={"zero_stage": 0}),
        case("pp_tied", parallelism_config=pp, model_config=TIED),
        case("tp_fp8", parallelism_config={"tensor_parallel_size": 2}, memory_config={"zero_stage": 0, "precision": "FP8"}),
        case("pp_fp8", parallelism_config=pp, memory_config={"precision": "FP8"}),
        case("pp_fp16", parallelism_config=pp, memory_config={"precision": "FP16"}),
        case("zero0_offload", memory_config={"zero_stage": 0, "cpu_offload": True}),
        case("pp_moe", parallelism_config=pp, model_config=MOE_BALANCED),
        case("zero3_nvme", memory_config={"zero_stage": 3, "nvme_offload": True}),
        {"name": "lora_zero3", "job": finetune_job(root, "lora-zero3", zero_stage=3), "options": FAST},
        # fine-tunes under TP and PP; exported (hf-final / adapter-final) to compare with one process's
        {"name": "ft_full_tp", "job": finetune_job(root, "ft-full-tp", 0, "full", parallelism_config={"tensor_parallel_size": 2}),
         "options": EXPORT},
        {"name": "ft_full_pp", "job": finetune_job(root, "ft-full-pp", 3, "full", parallelism_config=pp), "options": EXPORT},
        {"name": "ft_full_zero3", "job": finetune_job(root, "ft-full-zero3", 3, "full"), "options": EXPORT},  # dp 2
        {"name": "ft_lora_pp", "job": finetune_job(root, "ft-lora-pp", 3, "lora", parallelism_config=pp), "options": EXPORT},
        {"name": "ft_lora_tp", "job": finetune_job(root, "ft-lora-tp", 3, "lora", parallelism_config={"tensor_parallel_size": 2}),
         "options": EXPORT},
        # stopped after step 2 and resumed from its checkpoint: a LoRA fine-tune under TP, a full one under PP
        *({"name": f"{name}_{phase}", "job": finetune_job(root, folder, zero, method, parallelism_config=parallel),
           "options": {**FAST, **({"stop_at_step": 2} if phase == "stop" else {})}}
          for name, folder, zero, method, parallel in (("ft_lora_tp", "ft-lora-tp-sr", 3, "lora", {"tensor_parallel_size": 2}),
                                                       ("ft_full_pp", "ft-full-pp-sr", 3, "full", pp))
          for phase in ("stop", "resume")),
        # the same fine-tunes from the base's GGUF file (F32: the folder's weights, tokenizer and template)
        {"name": "ft_lora_tp_gguf", "job": finetune_job(root, "ft-lora-tp-gguf", 3, "lora", gguf=True,
                                                        parallelism_config={"tensor_parallel_size": 2}), "options": FAST},
        {"name": "ft_full_pp_gguf", "job": finetune_job(root, "ft-full-pp-gguf", 3, "full", gguf=True, parallelism_config=pp),
         "options": FAST},
    ]
    return launch_scenarios(2, scenarios, tiny_paths, root / "out"), root


@pytest.fixture(scope="module")
def four_ranks(tiny_paths, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("four-ranks")
    scenarios = [
        {"name": "fsdp_tp", "job": tiny_job(tiny_paths, root / "fsdp_tp", parallelism_config={"tensor_parallel_size": 2},
                                             memory_config={"zero_stage": 3}), "options": FAST},
        {"name": "fsdp_tp_qwen3_sp", "job": tiny_job(tiny_paths, root / "sp", model_config=QWEN3, memory_config={"zero_stage": 3},
                                                     parallelism_config={"tensor_parallel_size": 2, "sequence_parallel": True}),
         "options": FAST},
        {"name": "pp_tp", "job": tiny_job(tiny_paths, root / "pp_tp", memory_config={"zero_stage": 3},
                                           parallelism_config={"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
         "options": FAST},
        {"name": "replicate_tp", "job": tiny_job(tiny_paths, root / "replicate_tp", memory_config={"zero_stage": 0},
                                                 parallelism_config={"tensor_parallel_size": 2}), "options": FAST},
    ]
    return launch_scenarios(4, scenarios, tiny_paths, root / "out")


def assert_losses_match(got: dict[str, float], expected: dict[str, float]) -> None:
    assert list(got) == list(expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), f"step {step}: {got[step]} != {loss}"


def placements(rank_result: dict, name: str) -> tuple[list[str], list[str], list[int], list[int]]:
    info = rank_result["sharding"][name]
    return info["mesh_dims"], info["placements"], info["local_shape"], info["shape"]


# ---- ZeRO stages ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_losses_equal_single_process(two_ranks, references, stage):
    ranks, _ = two_ranks
    for rank in ranks:
        assert_losses_match(rank[f"zero{stage}"]["losses"], references["llama"])


def test_zero0_replicates_parameters(two_ranks):
    ranks, _ = two_ranks
    for rank in ranks:
        dims, places, local, full = placements(rank["zero0"], "model.layers.0.mlp.up_proj.weight")
        assert dims == ["dp"] and places == ["Replicate()"] and local == full
        assert rank["zero0"]["exp_avg_local_shapes"]["model.layers.0.mlp.up_proj.weight"] == full


@pytest.mark.parametrize("stage, resharded", [(1, False), (2, False), (3, True)])
def test_zero_stages_shard_as_the_stage_says(two_ranks, stage, resharded):
    """Parameters, gradients' optimizer state: dim-0 halves on each rank. ZeRO-3 frees the gathered
    parameters after each layer's forward; ZeRO-1/2 keep them until backward."""
    ranks, _ = two_ranks
    for rank in ranks:
        result = rank[f"zero{stage}"]
        for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
            dims, places, local, full = placements(result, name)
            assert dims == ["dp"] and places == ["Shard(dim=0)"]
            assert local == [full[0] // 2, *full[1:]]
            assert result["exp_avg_local_shapes"][name] == local
        assert result["resharded_after_forward"] and set(result["resharded_after_forward"]) == {resharded}


# ---- pipeline ------------------------------------------------------------------------------------

def test_pipeline_1f1b_losses_equal_single_process(two_ranks, references):
    ranks, _ = two_ranks
    for rank in ranks:
        assert_losses_match(rank["pp"]["losses"], references["llama"])


def test_gpipe_and_interleaved_schedules_equal_single_process(two_ranks, references):
    ranks, _ = two_ranks
    for rank in ranks:
        assert_losses_match(rank["pp_gpipe"]["losses"], references["llama"])
        assert_losses_match(rank["pp_interleaved"]["losses"], references["llama4"])
    assert ranks[0]["pp_gpipe"]["pipeline"]["schedule"] == "ScheduleGPipe"
    # two virtual stages per rank, round-robin: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3
    assert [r["pp_interleaved"]["pipeline"]["stages"] for r in ranks] == [[0, 2], [1, 3]]
    assert ranks[0]["pp_interleaved"]["pipeline"]["schedule"] == "ScheduleInterleaved1F1B"


def test_pipeline_stages_hold_their_layers(two_ranks):
    ranks, _ = two_ranks
    first, last = ranks[0]["pp"], ranks[1]["pp"]
    for result, stage in ((first, 0), (last, 1)):
        assert result["pipeline"] == {"schedule": "Schedule1F1B", "microbatches": 4, "stages": [stage], "num_stages": 2}
    assert "model.embed_tokens.weight" in first["sharding"] and "lm_head.weight" not in first["sharding"]
    assert "lm_head.weight" in last["sharding"] and "model.embed_tokens.weight" not in last["sharding"]
    assert any(k.startswith("model.layers.0.") for k in first["sharding"])
    assert not any(k.startswith("model.layers.0.") for k in last["sharding"])
    assert any(k.startswith("model.layers.1.") for k in last["sharding"])


# ---- tensor parallel, FSDP x TP ------------------------------------------------------------------

def test_tensor_parallel_losses_equal_single_process(two_ranks, references):
    ranks, _ = two_ranks
    for rank in ranks:
        assert_losses_match(rank["tp"]["losses"], references["llama"])
        assert_losses_match(rank["tp_qwen3_sp"]["losses"], references["qwen3"])


def test_tensor_parallel_shards_columns_and_rows(two_ranks):
    ranks, _ = two_ranks
    for rank in ranks:
        result = rank["tp"]
        dims, places, local, full = placements(result, "model.layers.0.self_attn.q_proj.weight")
        assert dims == ["tp"] and places == ["Shard(dim=0)"] and local == [full[0] // 2, full[1]]
        dims, places, local, full = placements(result, "model.layers.0.mlp.down_proj.weight")
        assert places == ["Shard(dim=1)"] and local == [full[0], full[1] // 2]
        assert placements(result, "model.layers.0.input_layernorm.weight")[1] == ["Replicate()"]
        assert placements(result, "model.embed_tokens.weight")[1] == ["Shard(dim=0)"]  # vocabulary-parallel
        assert placements(rank["tp_qwen3_sp"], "model.layers.0.self_attn.q_norm.weight")[1] == ["Replicate()"]


def test_fsdp_times_tp_losses_equal_single_process(four_ranks, references):
    for rank in four_ranks:
        assert_losses_match(rank["fsdp_tp"]["losses"], references["llama"])
        assert_losses_match(rank["fsdp_tp_qwen3_sp"]["losses"], references["qwen3"])


# ---- fine-tuning a pretrained model: FSDP2, TP, PP ------------------------------------------------

@pytest.fixture(scope="module")
def finetune_references(two_ranks) -> dict:
    """One process, no parallelism wrappers: the full and the LoRA fine-tune each distributed case must equal."""
    _, root = two_ranks
    return {method: run_training(parse_job(finetune_job(root, f"ft-{method}-reference", 0, method)), RunOptions(**EXPORT))
            for method in ("full", "lora")}


def assert_finetune_matches(rank_result: dict, reference) -> None:
    """Losses of every step (step 1's is the pretrained base's: the weights reached every shard and stage)
    and the eval loss per assistant token."""
    assert_losses_match(rank_result["losses"], {str(k): v for k, v in reference.losses.items()})
    assert reference.val_loss is not None and rank_result["val_loss"] == pytest.approx(reference.val_loss, rel=1e-5)


def test_lora_finetune_under_fsdp_on_two_ranks_equals_single_process(two_ranks, finetune_references):
    """LoRA under FSDP2 over two data-parallel ranks: the frozen base sharded like any module, the
    adapter's gradients reduced across ranks; the losses equal one process on the same batches."""
    results, _ = two_ranks
    for rank in results:
        assert_losses_match(rank["lora_zero3"]["losses"], {str(k): v for k, v in finetune_references["lora"].losses.items()})


@pytest.mark.parametrize("kind", ["ft_full_tp", "ft_full_pp", "ft_full_zero3"])
def test_full_finetune_under_tp_pp_and_fsdp_equals_single_process(two_ranks, finetune_references, kind):
    """Full fine-tuning of a tied-embedding base with tensor_parallel_size 2 (ZeRO 0),
    pipeline_parallel_size 2 (ZeRO 3) and FSDP2 over two data-parallel ranks (ZeRO 3): the packed
    examples' boundaries reach every stage, the loss is
    on the assistant tokens; the hf-final folder, loaded by transformers, holds the single process's
    weights (within 1 % of what training changed: Adam divides by the gradients' own size)."""
    results, root = two_ranks
    for rank in results:
        assert_finetune_matches(rank[kind], finetune_references["full"])
    base = load_reference(root / "ft-base").state_dict()
    expected = load_reference(root / "ft-full-reference" / "hf-final").state_dict()
    got = load_reference(root / kind.replace("_", "-") / "hf-final").state_dict()
    assert got.keys() == expected.keys()
    update = max(float((expected[k] - base[k]).abs().max()) for k in expected)
    error = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    assert update > 1e-4 and error < 1e-2 * update, (error, update)


def test_finetune_shards_and_stages_the_pretrained_model(two_ranks):
    results, _ = two_ranks
    for rank in results:
        dims, places, local, full = placements(rank["ft_full_tp"], "model.layers.0.self_attn.q_proj.weight")
        assert dims == ["tp"] and places == ["Shard(dim=0)"] and local == [full[0] // 2, full[1]]
        lora = rank["ft_lora_tp"]  # (dp, tp) mesh under ZeRO 3 on one dp rank: the tp placement is the second
        column, row = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"
        tp = {name: placements(lora, f"{name}.weight")[1][1] for name in
              (column, f"{column}.adapter.lora_A", f"{column}.adapter.lora_B", row, f"{row}.adapter.lora_A", f"{row}.adapter.lora_B")}
        assert tp == {column: "Shard(dim=0)", f"{column}.adapter.lora_A": "Replicate()", f"{column}.adapter.lora_B": "Shard(dim=0)",
                      row: "Shard(dim=1)", f"{row}.adapter.lora_A": "Shard(dim=1)", f"{row}.adapter.lora_B": "Replicate()"}
        trained = lora["exp_avg_local_shapes"]  # optimizer state: the base stays frozen through the distribution
        assert trained and all(".adapter.lora_" in name for name in trained)
    for kind in ("ft_full_pp", "ft_lora_pp"):
        first, last = (set(rank[kind]["sharding"]) for rank in results)
        assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
        assert not any(name.startswith("model.layers.1.") for name in first)
        assert not any(name.startswith("model.layers.0.") for name in last)


@pytest.mark.parametrize("kind", ["ft_lora_pp", "ft_lora_tp"])
def test_lora_finetune_under_pp_and_tp_equals_single_process(two_ranks, finetune_references, kind):
    """LoRA with pipeline_parallel_size 2 (the frozen tied embedding has no gradient to share between
    the stages; adapter-final written from the stages' checkpoint) and with tensor_parallel_size 2 under
    ZeRO 3 (the pairs sharded beside their projections, lora_parallel.py): losses, grad norms (A's
    gradient is a sum over the TP ranks) and the adapter equal one process's."""
    results, root = two_ranks
    for rank in results:
        assert_finetune_matches(rank[kind], finetune_references["lora"])
    assert grad_norms(root / kind.replace("_", "-")) == pytest.approx(grad_norms(root / "ft-lora-reference"), rel=1e-4)
    expected = load_adapter(root / "ft-lora-reference" / "adapter-final")[2]
    got = load_adapter(root / kind.replace("_", "-") / "adapter-final")[2]
    assert got.keys() == expected.keys() and len(got) == 28  # 7 projections x 2 layers x (A, B)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6)


def test_moe_with_zero3_losses_equal_single_process(two_ranks, references):
    ranks, _ = two_ranks
    for rank in ranks:
        assert_losses_match(rank["moe_zero3"]["losses"], references["moe"])
        assert placements(rank["moe_zero3"], "model.layers.0.block_sparse_moe.experts.3.w1.weight")[1] == ["Shard(dim=0)"]


def test_pipeline_times_tp_on_a_3d_mesh(four_ranks, references):
    """pp 2 x dp 1 x tp 2: each pipeline stage is tensor-parallel (and FSDP-wrapped on its 1-rank dp dim)."""
    for rank in four_ranks:
        assert_losses_match(rank["pp_tp"]["losses"], references["llama"])
    stages = [rank["pp_tp"]["pipeline"]["stages"] for rank in four_ranks]
    assert stages == [[0], [0], [1], [1]]  # mesh order (pp, dp, tp): ranks 0,1 are stage 0's TP pair
    dims, _, local, full = placements(four_ranks[0]["pp_tp"], "model.layers.0.self_attn.q_proj.weight")
    assert dims == ["dp", "tp"] and local == [full[0] // 2, full[1]]


def test_fsdp_times_tp_uses_a_2d_mesh(four_ranks):
    for rank in four_ranks:
        result = rank["fsdp_tp"]
        # FSDP shards each TP shard again along dim 0 (a strided shard of the global tensor)
        dims, places, local, full = placements(result, "model.layers.0.self_attn.q_proj.weight")
        assert dims == ["dp", "tp"] and places == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        assert local == [full[0] // 4, full[1]]
        dims, places, local, full = placements(result, "model.layers.0.self_attn.o_proj.weight")
        assert places == ["Shard(dim=0)", "Shard(dim=1)"] and local == [full[0] // 2, full[1] // 2]
        assert set(result["resharded_after_forward"]) == {True}


# ---- tied embeddings (tied.py) -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tp_tied", "pp_tied"])
def test_tied_embeddings_equal_single_process(two_ranks, references, kind):
    """Loss and global gradient norm of every step equal one process's: TP keeps one Shard(0) DTensor
    for both uses, PP sums the first and last stage's gradients and counts the weight once in the norm
    (losses alone would not see a double count below the clipping threshold: the norm does)."""
    ranks, root = two_ranks
    for rank in ranks:
        assert_losses_match(rank[kind]["losses"], references["tied"])
    assert grad_norms(root / kind) == pytest.approx(references["tied_grad_norms"], rel=1e-4)


def test_tied_embedding_placements(two_ranks):
    ranks, _ = two_ranks
    for rank in ranks:
        sharding = rank["tp_tied"]["sharding"]
        assert "lm_head.weight" not in sharding  # one Parameter: named_parameters lists it once
        assert placements(rank["tp_tied"], "model.embed_tokens.weight")[1] == ["Shard(dim=0)"]
    first, last = ranks[0]["pp_tied"]["sharding"], ranks[1]["pp_tied"]["sharding"]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last


def test_fp8_under_tensor_and_pipeline_parallelism(two_ranks, references):
    """Float8Linear on TP shards (torchao scales a DTensor by its global amax) and on pipeline stages
    follows the one-process FP8 run; float8 rounding of differently-split matmuls allows 1e-3."""
    ranks, _ = two_ranks
    for rank in ranks:
        for kind in ("tp_fp8", "pp_fp8"):
            got = rank[kind]["losses"]
            assert got == pytest.approx(references["fp8"], rel=1e-3), kind
    assert ranks[0]["tp_fp8"]["losses"] != references["llama"]  # not the FP32 run: float8 ran


# ---- what used to be refused: FP16 x PP, cpu_offload x ZeRO-0, replicate x TP -----------------------

def test_fp16_pipeline_scales_the_loss_on_the_last_stage(two_ranks, references):
    """The schedule runs backward from the last stage's loss, so that loss is scaled there; every rank
    all-reduces found_inf (ShardedGradScaler over the world), so the stages skip or step together."""
    ranks, _ = two_ranks
    for rank in ranks:
        assert_losses_match(rank["pp_fp16"]["losses"], references["fp16"])


def test_moe_pipeline_trains_the_balance_loss_of_every_stage(two_ranks, references):
    """moe_pipeline.py: the first stage's MoE layers get their balance-loss gradient although the loss
    is on the last stage (checked: without the hooks step 3's loss is 3e-4 relative off, beyond the
    tolerance); the grad norms, which carry the router's gradient, match too."""
    ranks, root = two_ranks
    for rank in ranks:
        assert_losses_match(rank["pp_moe"]["losses"], references["moe_balanced"])
    assert grad_norms(root / "pp_moe") == pytest.approx(references["moe_balanced_grad_norms"], rel=1e-5)


def test_cpu_offload_with_zero0_replicates_in_host_memory(two_ranks, references):
    ranks, _ = two_ranks
    for rank in ranks:
        assert_losses_match(rank["zero0_offload"]["losses"], references["llama"])
        assert rank["zero0_offload"]["offload_policy"] == "CPUOffloadPolicy"
        assert rank["zero0"]["offload_policy"] == "OffloadPolicy"
        dims, places, local, full = placements(rank["zero0_offload"], "model.layers.0.mlp.up_proj.weight")
        assert dims == ["dp"] and places == ["Replicate()"] and local == full


def test_nvme_offload_of_sharded_states(two_ranks, references):
    """Each rank's files hold its FSDP shard of the states (half of dim 0); the losses are the FP32 run's."""
    ranks, root = two_ranks
    for rank in ranks:
        assert_losses_match(rank["zero3_nvme"]["losses"], references["llama"])
    import numpy as np

    for r in range(2):
        shard = np.load(root / "zero3_nvme" / "nvme-offload" / f"rank{r:05d}" / "part0" / "00000.exp_avg.npy")
        local = ranks[r]["zero3_nvme"]["sharding"]["model.embed_tokens.weight"]["local_shape"]
        assert list(shard.shape) == local and local[0] * 2 == ranks[r]["zero3_nvme"]["sharding"]["model.embed_tokens.weight"]["shape"][0]


def test_replicate_with_tensor_parallel(four_ranks, references):
    """zero_stage 0 on dp 2 x tp 2: replicate over dp of the TP shards."""
    for rank in four_ranks:
        assert_losses_match(rank["replicate_tp"]["losses"], references["llama"])
        dims, places, local, full = placements(rank["replicate_tp"], "model.layers.0.self_attn.q_proj.weight")
        assert dims == ["dp", "tp"] and places == ["Replicate()", "Shard(dim=0)"] and local == [full[0] // 2, full[1]]


# ---- exact resume and corrupt checkpoints -------------------------------------------------------

@pytest.mark.parametrize("kind", ["zero3", "pp"])
def test_resume_reproduces_the_uninterrupted_run_exactly(two_ranks, kind):
    ranks, _ = two_ranks
    for rank in ranks:
        stopped, resumed, whole = rank[f"{kind}_stop"], rank[f"{kind}_resume"], rank[kind]
        assert stopped["reason"] == "stopped" and list(stopped["losses"]) == ["1", "2", "3"]
        assert resumed["start_step"] == 3 and list(resumed["losses"]) == ["4", "5", "6"]
        for step, loss in resumed["losses"].items():
            assert loss == whole["losses"][step], f"{kind} step {step}: resumed {loss} != uninterrupted {whole['losses'][step]}"


@pytest.mark.parametrize("kind", ["ft_lora_tp", "ft_full_pp"])
def test_finetune_resume_under_tp_and_pp_reproduces_the_uninterrupted_run(two_ranks, kind):
    """A LoRA fine-tune under tensor parallelism and a full one under pipeline parallelism, stopped
    after step 2 and resumed from that checkpoint: steps 3-4 have the uninterrupted run's losses."""
    ranks, _ = two_ranks
    for rank in ranks:
        stopped, resumed, whole = rank[f"{kind}_stop"], rank[f"{kind}_resume"], rank[kind]
        assert stopped["reason"] == "stopped" and list(stopped["losses"]) == ["1", "2"]
        assert resumed["start_step"] == 2 and list(resumed["losses"]) == ["3", "4"]
        for step, loss in resumed["losses"].items():
            assert loss == whole["losses"][step], f"{kind} step {step}: resumed {loss} != uninterrupted {whole['losses'][step]}"


@pytest.mark.parametrize("kind", ["ft_lora_tp", "ft_full_pp"])
def test_finetune_from_a_gguf_base_under_tp_and_pp_equals_the_folder_base(two_ranks, kind):
    """The base read from its GGUF file (dequantized, the q/k rows un-permuted, the tokenizer and chat
    template from its metadata) and sharded (TP) or staged (PP) trains exactly as from the HF folder."""
    ranks, _ = two_ranks
    for rank in ranks:
        assert rank[f"{kind}_gguf"]["losses"] == rank[kind]["losses"] and len(rank[kind]["losses"]) == 4


def test_corrupt_shard_is_caught_and_the_previous_checkpoint_used(two_ranks):
    ranks, root = two_ranks
    for rank in ranks:
        result = rank["zero3_corrupt"]
        assert result["start_step"] == 4  # step-6 was corrupted: back to step-4
        assert result["losses"] == {k: v for k, v in rank["zero3"]["losses"].items() if int(k) > 4}
    events = [json.loads(line) for line in (root / "z3" / "events.jsonl").read_text().splitlines()]
    corrupt = [e for e in events if e["event"] == "checkpoint" and e["status"] == "CORRUPT"]
    assert len(corrupt) == 1 and corrupt[0]["step"] == 6 and "model/__1_0.distcp checksum" in corrupt[0]["reason"]
    started = [e for e in events if e["event"] == "started"]
    assert started[-1]["step"] == 4 and started[-1]["resumed_from"] is not None
    assert [r["step"] for r in read_metrics(root / "z3" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
