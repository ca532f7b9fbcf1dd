"""Every tensor a step makes names its device, and a step talks to the host a fixed few times.

Runs on CPU-only CI (see tests/device_guard.py for what is watched and why it matters on a GPU),
over requests that exercise every path of a step: prefill chunks after a cached prefix, decodes,
sliding windows, both decode-attention backends, penalties, seeds, top-k/p, min-p, n > 1,
logprobs and prompt logprobs, beam search, preemption by swap.
"""
from __future__ import annotations

import pytest
import torch

from device_guard import StepGuard
from pagedllm import BeamSearchParams, LLMEngine, SamplingParams
from pagedllm.engine.beam_search import BeamSearcher

# One device->host read per step (the sampled tokens with their logprobs), and a fixed number of
# host->device transfers however many sequences share the step.
MAX_READS = 1
MAX_TRANSFERS = 4

PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5, max_tokens=8),
    SamplingParams(n=2, temperature=1.0, frequency_penalty=0.3, min_tokens=4, max_tokens=7, ignore_eos=True),
    SamplingParams(n=1, best_of=3, temperature=0.7, max_tokens=6, logprobs=1),
]

ENGINES = {
    "defaults": ("llama", {}),
    "chunked_small_budget": ("mistral", dict(max_num_batched_tokens=24, block_size=4)),
    "swap": ("qwen3", dict(num_kv_blocks=14, block_size=4, preemption_mode="swap", swap_space=1 << 20)),
    "sdpa": ("qwen2", dict(attention_backend="sdpa", block_size=8)),
}


def devices() -> list:
    marks = [pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])]
    return ["cpu", *marks]


def run_guarded(folder: str, device: str, **engine_args) -> StepGuard:
    engine = LLMEngine.from_engine_args(folder, device=device, **engine_args)
    guard = StepGuard()
    guard.watch(engine)
    prompts = ["def parse(args):\n    ", "import os\nimport sys\n" * 3, "class Shape:\n    def area(self):", "x = 1"]
    for index in range(12):
        engine.add_request(str(index), prompts[index % len(prompts)] + " " * (index % 3), PARAMS[index % len(PARAMS)])
    searcher = BeamSearcher(engine)  # its one-token requests run beside the others
    searcher.add("beams", prompts[1], BeamSearchParams(beam_width=3, max_tokens=8))
    while engine.has_unfinished_requests() or searcher.has_unfinished():
        searcher.step()
    return guard


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", list(ENGINES))
def test_steps_name_their_device_and_talk_to_the_host_a_fixed_few_times(model_dir, mode, device):
    arch, engine_args = ENGINES[mode]
    guard = run_guarded(str(model_dir(arch)), device, **engine_args)
    assert len(guard.steps) > 5
    for index, step in enumerate(guard.steps):
        where = f"step {index} of {len(guard.steps)}"
        assert not step.implicit_device, f"{where}: factory calls without a device: {step.implicit_device}"
        assert not step.wrong_device, f"{where}: tensors made off the engine's device: {step.wrong_device}"
        reads = [s for s in step.syncs if s not in ("torch.Tensor.cpu", "torch.Tensor.to(cpu)")]
        assert len(reads) <= MAX_READS, f"{where}: {len(reads)} device->host reads: {reads}"
        copies = len(step.syncs) - len(reads)
        assert copies <= (1 if mode == "swap" else 0), f"{where}: device->host copies: {step.syncs}"
        assert len(step.transfers) <= MAX_TRANSFERS, f"{where}: {len(step.transfers)} host->device transfers"


def test_the_guard_sees_what_it_guards_against():
    """The watched calls are recorded when they happen (the guard itself can fail)."""
    from device_guard import StepRecord, _Mode

    record = StepRecord()
    values = torch.arange(4, device="cpu")
    with _Mode(torch.device("cpu"), record):
        torch.zeros(3)
        torch.tensor([1, 2], device="cpu")
        values.tolist()
        int(values[0])
        values.to("cpu")
        torch.ones(2, device="meta")
    assert record.implicit_device == ["torch.zeros"]
    assert record.transfers == ["torch.tensor"]
    assert record.syncs == ["torch.Tensor.tolist", "torch.Tensor.__int__", "torch.Tensor.to(cpu)"]
    assert record.wrong_device == ["torch.ones(device=meta)"]
