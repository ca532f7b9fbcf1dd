"""NVMe offload (training/nvme_offload.py): optimizer states in .npy files, streamed one parameter at a
time. Against cpu_offload (states resident in host memory): the same losses bit for bit, a step's peak
RSS lower by about the states' size (each measured in its own fresh process), and an exact resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, Trainer, init_distributed

from .helpers import tiny_job

FAST = {"peak_flops": 1e10, "export_hf": False}
# ~34M parameters: AdamW's two states take 275 MB, well above the allocator's noise
WIDE = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8, "num_kv_heads": 8}


def run(paths: dict, folder: Path, options: dict | None = None, **memory) -> tuple[dict, Trainer]:
    init_distributed()
    trainer = Trainer(parse_job(tiny_job(paths, folder, memory_config=memory)), RunOptions(**FAST, **(options or {})))
    return trainer.run().losses, trainer


def test_offloaded_states_give_the_resident_run_and_resume_exactly(tiny_paths, tmp_path):
    resident, _ = run(tiny_paths, tmp_path / "cpu", cpu_offload=True)
    offloaded, trainer = run(tiny_paths, tmp_path / "nvme", nvme_offload=True)
    assert offloaded == resident  # bit for bit: the same AdamW arithmetic on the mapped states
    files = sorted(p.name for p in (tmp_path / "nvme" / "nvme-offload" / "rank00000" / "part0").iterdir())
    assert "00000.exp_avg.npy" in files and "00000.exp_avg_sq.npy" in files
    assert all(not isinstance(v, torch.Tensor) or v.ndim == 0
               for state in trainer.optimizers[0].state.values() for v in state.values())  # nothing big resident
    stopped, _ = run(tiny_paths, tmp_path / "resume", {"stop_at_step": 3}, nvme_offload=True, nvme_offload_dir=str(tmp_path / "scratch"))
    assert list(stopped) == [1, 2, 3]
    resumed, _ = run(tiny_paths, tmp_path / "resume", nvme_offload=True, nvme_offload_dir=str(tmp_path / "scratch"))
    assert resumed == {step: offloaded[step] for step in (4, 5, 6)}
    assert (tmp_path / "scratch" / "rank00000" / "part0" / "00000.exp_avg.npy").exists()


def test_step_peak_rss_is_lower_by_the_states(tiny_paths, tmp_path):
    for name, memory in (("cpu", {"cpu_offload": True}), ("nvme", {"nvme_offload": True})):
        folder = tmp_path / name
        folder.mkdir()
        job = tiny_job(tiny_paths, folder, model_config=WIDE, memory_config=memory,
                       data_config={"global_batch_size": 2, "micro_batch_size": 2})
        (folder / "job.json").write_text(json.dumps(job))
        # one after the other: they share the corpus's token cache (the first may build it), and
        # neither's peak should depend on the other's. glibc's dynamic mmap threshold decides whether
        # a freed parameter-sized buffer goes back to the kernel or stays in the heap, differently
        # from run to run: pinned, the peaks compare like for like
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        proc = subprocess.run([sys.executable, "-m", "pagedllm.bench.step_memory", str(folder / "job.json"),
                               str(folder / "out.json")], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    cpu, nvme = (json.loads((tmp_path / name / "out.json").read_text()) for name in ("cpu", "nvme"))
    states = cpu["state_bytes"]
    saved = cpu["peak"] - nvme["peak"]
    assert 0.7 * states < saved < 1.3 * states, (saved, states, cpu, nvme)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "nvme" / "nvme-offload").rglob("*.npy"))
    assert states <= on_disk < states + 200 * 128  # the states, plus a .npy header per file
