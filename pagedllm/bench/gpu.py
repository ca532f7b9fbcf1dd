"""Offline throughput on a GPU: pagedllm against transformers' continuous batching, the share of a
decode step the GPU is busy, and single-stream decode against the memory's bandwidth.

`pagedllm bench offline --device cuda --shape llama-1b` runs, in one process on one GPU:

- the offline workload (by default 256 requests, prompts U[64, 512] tokens, outputs U[64, 512],
  greedy, ignore_eos) through pagedllm and through transformers' `generate_batch` machinery
  (continuous batching, `attn_implementation="paged|sdpa"`; each request keeps its own
  `max_new_tokens`, so both engines make exactly the same tokens), and optionally transformers'
  padded `generate` in batches of 64;
- the share of the wall time of steady decode steps (128 sequences) during which a GPU kernel
  runs, read from torch.profiler's device events (the union of kernel intervals over the wall time
  of the profiled steps; the profiler's own CPU overhead counts against us);
- single-stream decode tok/s (the rate from the first to the last token of 512) against the
  bandwidth limit: a decode step reads every weight once, so its best time is the weights' bytes
  over the device-to-device copy bandwidth measured in this run.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pagedllm.bench.engine_args import parse_engine_args
from pagedllm.bench.workload import Workload

BUSY_BATCH = 128  # sequences in the profiled decode steps
BUSY_STEPS = 20


def build_model_on_gpu(folder: Path, config_class: str, shape: dict, dtype: torch.dtype) -> Path:
    """A random model of the shape saved in `dtype`, initialised on the GPU (a 1B model's
    initialisation takes minutes on a CPU); cached between runs."""
    if (folder / "config.json").is_file():
        return folder
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**shape, initializer_range=0.02)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def copy_bandwidth(size_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s moved by a device-to-device copy, counting bytes read and written (the ceiling a
    weight-streaming decode step can approach)."""
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * size_bytes / best


def run_pagedllm(folder: Path, workload: Workload, engine_args: dict) -> tuple[float, "object"]:
    """Seconds for the workload; the engine is kept for the decode measurements that follow."""
    from pagedllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(str(folder), **engine_args)
    print(f"pagedllm engine ready in {time.perf_counter() - started:.1f} s (weights, KV sizing, CUDA graphs)")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    llm.generate(workload.prompts[:4], params[:4], use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    return elapsed, llm


def decode_busy_share(llm, vocab: int, batch: int = BUSY_BATCH, steps: int = BUSY_STEPS) -> tuple[float, float, float]:
    """(GPU busy share, wall ms per step under the profiler, wall ms per step without it) over
    `steps` steady engine steps of `batch` decoding sequences (each engine step a burst of
    num_scheduler_steps greedy steps where the engine has them: ms are then per engine step)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    per_step = engine.planner.num_scheduler_steps  # greedy steps per engine step (a burst: --engine-arg num_scheduler_steps=8)
    # final outputs only, as the offline workload's LLM.generate asks for them (no per-step snapshots)
    params = SamplingParams(temperature=0, max_tokens=(2 * steps + 16) * per_step, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        engine.add_request(f"busy-{i}", {"prompt_token_ids": [(7 * i + j) % (vocab - 20) + 10 for j in range(128)]}, params)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_ms = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy_us, reach = 0.0, float("-inf")
    for begin, end in intervals:  # the union of kernel intervals
        if end > reach:
            busy_us += end - max(begin, reach)
            reach = end
    print(f"  {len(intervals) / steps:.0f} kernels per engine step; the most time-consuming:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    return busy_us / 1e6 / wall, wall / steps * 1e3, plain_ms


def single_stream_rate(llm, vocab: int, prompt_len: int = 128, tokens: int = 512) -> float:
    """Decode tok/s of one greedy sequence, from its first token to its last."""
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.add_request("single", {"prompt_token_ids": [(13 * j) % (vocab - 20) + 10 for j in range(prompt_len)]}, params)
    stamps: list[tuple[float, int]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps.append((time.perf_counter(), len(out.outputs[0].token_ids)))
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return (n1 - n0) / (t1 - t0)


def weight_bytes(llm) -> int:
    """Bytes of weights a decode step reads: every layer's projections and norms, the final norm
    and the LM head (the embedding table only once when tied; a step reads one row of it)."""
    cfg, runner = llm.llm_engine.model_config, llm.llm_engine.runner
    hidden, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = hidden * (cfg.num_heads * cfg.head_dim + 2 * kv) + cfg.num_heads * cfg.head_dim * hidden
    per_layer += 3 * hidden * cfg.intermediate_size + 2 * hidden
    return (cfg.num_layers * per_layer + hidden + cfg.vocab_size * hidden) * runner.dtype.itemsize


def run_transformers_batching(folder: Path, workload: Workload, dtype: torch.dtype) -> float | None:
    """Seconds for the workload through transformers' continuous batching (paged|sdpa), each
    request with its own max_new_tokens; None when this transformers has no such API."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="paged|sdpa").to("cuda").eval()
    config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    if not hasattr(model, "continuous_batching_context_manager"):
        print("transformers has no continuous batching API here")
        return None
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30) as manager:
        warm = manager.add_request(workload.prompts[0], max_new_tokens=4)
        _collect(manager, {warm})
        torch.cuda.synchronize()
        start = time.perf_counter()
        ids = {manager.add_request(p, max_new_tokens=n) for p, n in zip(workload.prompts, workload.output_lens)}
        produced = _collect(manager, ids)
        elapsed = time.perf_counter() - start
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    del model
    torch.cuda.empty_cache()
    return elapsed


def _collect(manager, ids: set[str]) -> int:
    """Waits for every request in `ids`; the number of tokens they generated."""
    produced, pending = 0, set(ids)
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.request_id in pending and result.is_finished():
            pending.discard(result.request_id)
            produced += len(result.generated_tokens)
    return produced


def run_transformers_padded(folder: Path, workload: Workload, dtype: torch.dtype, batch: int = 64) -> float:
    """Seconds for the workload as left-padded `generate` batches of `batch` (each runs to its
    longest output; credited with the tokens asked for)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None
    total = 0.0
    with torch.inference_mode():
        for first in range(0, len(workload.prompts), batch):
            prompts = workload.prompts[first : first + batch]
            longest = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(prompts):
                ids[row, longest - len(prompt):] = torch.tensor(prompt)
                mask[row, longest - len(prompt):] = 1
            ids, mask = ids.cuda(), mask.cuda()
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                           max_new_tokens=max(workload.output_lens[first : first + batch]))
            torch.cuda.synchronize()
            total += time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return total


def run(args: argparse.Namespace, config_class: str, shape: dict, workload: Workload, folder: Path) -> int:
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    folder = build_model_on_gpu(folder, config_class, shape, dtype)
    vocab = shape["vocab_size"]
    name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{name}, torch {torch.__version__}, {args.dtype}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)")
    engine_args = {"device": "cuda", "dtype": args.dtype, "max_model_len": args.max_prompt + args.max_output + 64}
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine_args.update(parse_engine_args(args.engine_arg))
    ours, llm = run_pagedllm(folder, workload, engine_args)
    print(f"pagedllm:                 {ours:7.1f} s  {workload.output_tokens / ours:9.1f} output tok/s")
    share, step_ms, plain_ms = decode_busy_share(llm, vocab)
    per_step = llm.llm_engine.planner.num_scheduler_steps
    print(f"engine steps of {BUSY_BATCH} decoding sequences, {per_step} greedy step(s) each: {plain_ms:.2f} ms each "
          f"({BUSY_BATCH * per_step / plain_ms * 1e3:.0f} tok/s); under torch.profiler {step_ms:.2f} ms, GPU busy {share:.1%} of it")
    runner = llm.llm_engine.runner
    print(f"attention backend {runner.attention_backend}, CUDA graphs "
          f"{'off' if runner.graphs is None else f'{len(runner.graphs.graphs)} sizes, {runner.graphs.num_replays} replays'}, "
          f"{runner.num_blocks} KV blocks; async scheduling "
          f"{f'on ({llm.llm_engine.scheduler.num_deferred_steps} steps deferred)' if runner.planner.async_scheduling else 'off'}")
    rate = single_stream_rate(llm, vocab)
    limit = bandwidth / weight_bytes(llm)
    print(f"single stream: {rate:.1f} tok/s; bandwidth limit {limit:.0f} tok/s ({weight_bytes(llm) / 1e9:.2f} GB of "
          f"weights) -> {rate / limit:.1%} of it")
    llm.llm_engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    theirs = None if args.skip_transformers else run_transformers_batching(folder, workload, dtype)
    if theirs is not None:
        print(f"transformers generate_batch (paged|sdpa): {theirs:7.1f} s  {workload.output_tokens / theirs:9.1f} output tok/s")
        print(f"speed-up over generate_batch: {theirs / ours:.2f}x")
    if args.padded_baseline:
        padded = run_transformers_padded(folder, workload, dtype)
        print(f"transformers padded generate (batches of 64): {padded:7.1f} s  {workload.output_tokens / padded:9.1f} output tok/s")
        print(f"speed-up over padded generate: {padded / ours:.2f}x")
    return 0
