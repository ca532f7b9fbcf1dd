"""`pagedllm bench offline --model FILE.gguf`: the engine on the file's kept blocks against a
baseline on the same weights, dequantized into an HF folder by transformers; the engines take
turns. The vLLM baseline needs its own venv (bench/vllm_cpu.py): only its refusal is tested here."""
from __future__ import annotations

import json
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.bench import vllm_cpu
from pagedllm.bench.dequantized import dequantized_folder
from pagedllm.cli import main


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_offline_bench_on_a_gguf_against_transformers_in_turns(tiny_gguf, temp_dir, capsys):
    gguf = tiny_gguf("llama", "Q4_0")
    status = main(["bench", "offline", "--model", str(gguf), "--num-requests", "3", "--min-prompt", "4",
                   "--max-prompt", "8", "--fixed-output-len", "4", "--rounds", "2"])
    out = capsys.readouterr().out
    assert status == 0
    assert "pagedllm output tok/s each round: " in out and "transformers output tok/s each round: " in out
    assert "speed-up over transformers: " in out
    assert "pagedllm KV pool: " in out and "requests preempted each run: 0, 0" in out


def test_against_vllm_both_engines_get_the_same_kv_memory():
    """vLLM's worker gets --kv-cache-gib (VLLM_CPU_KVCACHE_SPACE) and pagedllm the same bytes as
    kv_cache_memory: its default pool (one full context) preempted 27 of the long workload's 64
    requests where vLLM's 4 GiB held them all. A pool the engine arguments size wins; 0 keeps
    pagedllm's default."""
    from pagedllm.bench.offline import _with_kv_memory

    assert _with_kv_memory({}, 4) == {"kv_cache_memory": 4 << 30}
    for sized in ({"kv_cache_memory": 1 << 30}, {"num_kv_blocks": 64}, {"kv_cache_memory_fraction": 0.5}):
        assert _with_kv_memory(sized, 4) == sized
    assert _with_kv_memory({"max_num_seqs": 8}, 0) == {"max_num_seqs": 8}


def test_the_dequantized_folder_holds_the_files_weights_once(tiny_gguf, temp_dir):
    gguf = tiny_gguf("llama", "Q8_0")
    folder = dequantized_folder(gguf)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # plain tensors a folder reader loads
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert dequantized_folder(gguf) == folder and (folder / "config.json").stat().st_mtime_ns == stamp
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name


def test_against_vllm_needs_its_venv(monkeypatch):
    monkeypatch.delenv(vllm_cpu.PYTHON_ENV, raising=False)
    with pytest.raises(SystemExit, match="--vllm-python"):
        vllm_cpu.python_of(None)
