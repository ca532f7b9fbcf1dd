"""Fine-tuning end to end on a tiny model: `pagedllm finetune` (lora and full), `pagedllm export --merge`
served by the engine with transformers + PEFT's greedy tokens, exact resume of a LoRA job whose
checkpoints hold only the adapter, and the job file's finetune_config section."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.adapters.peft_format import load_adapter
from pagedllm.training.cli import main as training_cli
from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, run_training

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import build_model, load_reference  # noqa: E402

from .helpers import lora_job, write_chat  # noqa: E402

FAST = RunOptions(peak_flops=1e10)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("ft") / "llama", "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    return write_chat(tmp_path_factory.mktemp("chat") / "chat.jsonl")


def test_lora_cli_then_merge_is_served_like_transformers_with_peft(base, chat, tmp_path):
    from peft import PeftModel

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    out = tmp_path / "adapter"
    assert training_cli(["finetune", "--model", str(base), "--data", str(chat), "--method", "lora", "--out", str(out),
                         "--steps", "8", "--learning-rate", "1e-2", "--lora-rank", "4", "--lora-alpha", "8",
                         "--max-seq-len", "128", "--batch-size", "4", "--micro-batch-size", "2", "--peak-flops", "1e10"]) == 0
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "checkpoints"}
    metrics = [json.loads(line) for line in (out / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"]

    assert training_cli(["export", "--adapter", str(out), "--merge", "--out", str(tmp_path / "merged")]) == 0
    reference = PeftModel.from_pretrained(load_reference(base), str(out)).eval()
    prompt = [{"role": "user", "content": "import 7"}]
    llm = LLM(str(tmp_path / "merged"), kv_cache_memory=16 << 20, max_model_len=128)
    ids = llm.get_tokenizer().apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert list(got[0].outputs[0].token_ids)[:len(expected)] == expected


def test_lora_resume_is_exact_and_checkpoints_hold_only_the_adapter(base, chat, tmp_path):
    import torch.distributed.checkpoint as dcp

    straight = run_training(parse_job(lora_job(base, chat, tmp_path / "straight")), FAST)
    first = run_training(parse_job(lora_job(base, chat, tmp_path / "resumed")), RunOptions(peak_flops=1e10, stop_at_step=3))
    assert first.final_step == 3 and first.reason == "stopped"
    saved = dcp.FileSystemReader(str(tmp_path / "resumed" / "step-00000003" / "model")).read_metadata().state_dict_metadata
    assert saved and all(".adapter.lora_" in name for name in saved)  # no base weights in a LoRA checkpoint
    exported = tmp_path / "step3-adapter"
    assert training_cli(["export", "--checkpoint", str(tmp_path / "resumed" / "step-00000003"), "--out", str(exported)]) == 0
    assert len(load_adapter(exported)[2]) == len(saved)  # the checkpoint's adapter as a PEFT folder
    second = run_training(parse_job(lora_job(base, chat, tmp_path / "resumed")), FAST)
    assert second.start_step == 3
    assert [second.losses[s] for s in (4, 5, 6)] == [straight.losses[s] for s in (4, 5, 6)]
    assert second.val_loss == straight.val_loss is not None
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "straight" / "adapter-final" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "adapter-final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_finetune_writes_a_transformers_folder(base, chat, tmp_path):
    out = tmp_path / "full"
    assert training_cli(["finetune", "--model", str(base), "--data", str(chat), "--method", "full", "--out", str(out),
                         "--steps", "3", "--max-seq-len", "128", "--batch-size", "2", "--micro-batch-size", "2", "--peak-flops", "1e10"]) == 0
    model = load_reference(out)
    tuned, original = model.state_dict(), load_reference(base).state_dict()
    assert not torch.equal(tuned["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]


def test_a_bad_line_is_refused_before_training(base, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + "{oops\n")
    assert training_cli(["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert f"data_config.dataset_path: {data.resolve()}:2: not valid JSON" in capsys.readouterr().err


def test_the_job_file_section_runs_with_pagedllm_train(base, chat, tmp_path):
    """The same fine-tune as a TOML job file's [finetune_config] section (model_config left to the base)."""
    job = lora_job(base, chat, tmp_path / "ckpt", steps=2)
    sections = "".join(f"\n[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
                       for name, values in job.items() if isinstance(values, dict))
    config = tmp_path / "job.toml"
    config.write_text(f'job_name = "toml"\n{sections}')
    assert training_cli(["train", "--config", str(config), "--peak-flops", "1e10"]) == 0
    written = json.loads((tmp_path / "ckpt" / "job.json").read_text())
    assert written["model_config"]["hidden_size"] == 64 and written["finetune_config"]["method"] == "lora"
    assert (tmp_path / "ckpt" / "adapter-final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_fsdp_wrapped_adapter_jobs_match_unwrapped(base, chat, tmp_path, method):
    """zero_stage 3 (FSDP2, also on one rank: the default memory_config) with a frozen base: the
    same losses as the plain module, and the adapter is written."""
    def run(zero: int) -> list[float]:
        job = lora_job(base, chat, tmp_path / f"{method}-{zero}", steps=3, memory_config={"zero_stage": zero})
        job["finetune_config"]["method"] = method
        result = run_training(parse_job(job), FAST)
        return [result.losses[s] for s in sorted(result.losses)]

    assert run(3) == pytest.approx(run(0), rel=1e-5)
    assert (tmp_path / f"{method}-3" / "adapter-final" / "adapter_model.safetensors").is_file()
