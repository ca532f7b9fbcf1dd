"""The peak resident memory of ONE training step, in a fresh process (what `bench train --nvme-offload`
and tests/training/test_nvme_offload.py compare between cpu_offload and nvme_offload):

    python -m pagedllm.bench.step_memory job.json out.json

Builds the job's Trainer, takes step 1 (which creates the optimizer states), resets the kernel's
peak-RSS mark (/proc/self/clear_refs, "5"), takes step 2 and writes {"before", "peak", "state_bytes"}:
the RSS before step 2, its high-water mark during step 2, and the bytes of optimizer state tensors.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from pagedllm.training.config import parse_job
from pagedllm.training.trainer import RunOptions, Trainer, init_distributed


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def main(job_path: str, out_path: str) -> None:
    init_distributed()
    trainer = Trainer(parse_job(json.loads(Path(job_path).read_text())), RunOptions(peak_flops=1e10, export_hf=False))
    trainer.train_step(1)
    # what the states take resident: AdamW's exp_avg and exp_avg_sq, the same size as the (local) parameters
    state_bytes = 2 * sum(local(p).numel() * local(p).element_size() for part in trainer.parts for p in part.parameters())
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    trainer.train_step(2)
    Path(out_path).write_text(json.dumps({"before": before, "peak": status_bytes("VmHWM"), "state_bytes": state_bytes}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
