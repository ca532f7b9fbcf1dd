"""Model runner: turns a scheduler step into one forward pass and the samples it yields.

It owns the model (with the fused decode step attached for small all-decode steps on CPU,
models/fused_decode.py), the KV pool and the per-sequence sampling generators, and sees only the
step's plain metadata (`SchedulerOutput`), never request state. For each step it applies the
swap and copy-on-write maps, stages the flat batch (worker/input_batch.py) and the sampling
parameters (worker/sampling_inputs.py) in one transfer per dtype, runs the forward pass, samples
on the device and reads the results back in one copy (worker/step_results.py).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from pagedllm.config import EngineConfig, ModelConfig, available_memory_bytes
from pagedllm.distributed.group import ParallelGroup
from pagedllm.engine.scheduler_output import SampleRow, ScheduledChunk, SchedulerOutput
from pagedllm.layers import kernels
from pagedllm.layers.paged_decode import kernel_supported, load
from pagedllm.layers.sampler import Sampler
from pagedllm.layers.small_matmul import MAX_ROWS
from pagedllm.models.fused_decode import FusedDecoder, unsupported as fused_unsupported
from pagedllm.models.loader import load_model
from pagedllm.spec_decode.rejection import rejection_sample
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.worker.input_batch import attention_metadata, stage_batch
from pagedllm.worker.kv_cache import KVCache, bytes_per_block, bytes_per_layer_block
from pagedllm.worker.kv_offload import LayerwiseKVOffload
from pagedllm.worker.malloc import keep_freed_memory
from pagedllm.worker.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.worker.sampling_inputs import sampling_metadata, stage_sampling
from pagedllm.worker.staging import Staging
from pagedllm.worker.step_results import fetch_results, score_prompt_tokens, stage_logit_rows


class ModelRunner:
    """Under tensor parallelism there is one runner per rank (`group`), each with its part of the
    model and of every KV block, all given the same `pool_sizes`; only rank 0 samples."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 group: ParallelGroup | None = None, pool_sizes: tuple[int, int] | None = None):
        self.config = config
        self.model_config = model_config
        self.group = group
        self.device = config.torch_device(group.rank if group is not None else 0)
        self.dtype = config.torch_dtype(model_config)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cpu":
            keep_freed_memory()
        fused_library = self._fused_decode_library()
        self.model = load_model(model_config, max_model_len, self.dtype, self.device, group, quantization=config.quantization,
                                panel_width=fused_library.panel_width() if fused_library is not None else None)
        self.speculator = None
        if config.speculative_config is not None:
            self.speculator = Speculator(config.speculative_config, model_config, max_model_len, self.block_size, self.dtype, self.device)
        self.num_blocks, self.num_cpu_blocks = pool_sizes or self._pool_sizes()
        self.kv_cache = KVCache(self.model.config, self.num_blocks, self.num_cpu_blocks, self.block_size, self.dtype,
                                self.device, host_pool=config.kv_offload)
        self.offload = self._offload() if config.kv_offload else None
        for index, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(*(self.offload.buffer(0) if self.offload else self.kv_cache.layer(index)))
        self.windows = sorted(set(model_config.sliding_windows), key=lambda w: (w is not None, w or 0))
        self.sampler = Sampler(config.seed, self.device, kernels.load() if self.device.type == "cpu" else None)
        self.kernel_attention = self._choose_attention_backend()
        if fused_library is not None and self.kernel_attention:
            self.model.fused = FusedDecoder(self.model, fused_library)
        elif fused_library is not None:  # the attention kernel is off: the fused step cannot run
            if config.decode_backend == "fused":
                raise RuntimeError("decode_backend='fused' needs the C decode attention kernel, which is not in use")
            for linear in self.model.linears():
                if linear.library is None:  # kept blocks are the weight itself
                    linear.small = None
        if self.speculator is not None:
            self.speculator.allocate(self.num_blocks, self.num_cpu_blocks, self.kernel_attention, self.model.fused)
        self.target_time_s = 0.0  # in execute() before proposing
        self.generators: dict[int, torch.Generator] = {}  # seq id -> a seeded sequence's own generator

    def _offload(self) -> LayerwiseKVOffload:
        per_layer_block = bytes_per_layer_block(self.model.config, self.block_size, self.dtype)
        budget = self.config.kv_offload_device_memory
        buffer_blocks = min(self.num_blocks, budget // (2 * per_layer_block)) if budget is not None else self.num_blocks
        if buffer_blocks < 1:
            raise ValueError(f"kv_offload_device_memory={budget} bytes holds no block of two layers "
                             f"({2 * per_layer_block} bytes)")
        offload = LayerwiseKVOffload(self.kv_cache, self.model.attention_layers(), buffer_blocks, self.device)
        self.model.model.layer_hook = offload
        return offload

    @property
    def max_step_blocks(self) -> int | None:
        """The most KV blocks one step may use (layer-wise offload's buffer), if bounded."""
        return self.offload.buffer_blocks if self.offload is not None else None

    def _fused_decode_library(self):
        """The kernel library when the fused decode step can run (auto), else None; with
        decode_backend='fused' a reason it cannot is an error."""
        backend = self.config.decode_backend
        if backend == "torch":
            return None
        reasons = fused_unsupported(self.model_config, self.dtype, self.device)
        if self.config.attention_backend == "sdpa":
            reasons.append("it attends with the C decode kernel (attention_backend auto or kernel)")
        if self.group is not None or self.config.kv_offload:
            reasons.append("it runs the whole model over KV pools bound once (no tensor parallelism, no KV offload)")
        library = kernels.load() if not reasons else None
        if not reasons and library is None:
            reasons.append("the CPU kernels could not be built (see the log)")
        if reasons and backend == "fused":
            raise ValueError("decode_backend='fused' cannot be used: " + "; ".join(reasons))
        return library

    def _choose_attention_backend(self) -> bool:
        """The C attention kernels (decode and prefill) for fp32 on CPU when they build (auto), else SDPA."""
        backend = self.config.attention_backend
        k_cache = self.model.attention_layers()[0].k_cache  # the pool, or the offload buffer
        if backend == "sdpa" or (backend == "auto" and not kernel_supported(k_cache)):
            return False
        if not kernel_supported(k_cache):
            raise ValueError(
                "attention_backend='kernel' needs float32 KV caches on the CPU and a head_dim that is a multiple "
                "of 8; use 'sdpa' or 'auto'"
            )
        if load() is not None:
            return True
        if backend == "kernel":
            raise RuntimeError("attention_backend='kernel' was asked for, but the kernel could not be built (see the log)")
        return False

    def _pool_sizes(self) -> tuple[int, int]:
        extra = self.speculator.bytes_per_block() if self.speculator is not None else 0  # the draft's mirror pool
        return kv_pool_sizes(self.config, self.model.config, self.max_model_len, extra)

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        self._forget(sched.finished_seq_ids)
        if self.offload is not None:
            sched = self._offload_step(sched)
        staging = Staging()
        _stage_block_maps(sched, staging)
        if not sched.chunks:
            self._apply_block_maps(sched, staging.to(self.device))
            return ModelRunnerOutput()
        if sched.num_steps > 1:
            return self._greedy_steps(sched, staging)
        if sched.fused_spec_cycles:
            self._apply_block_maps(sched, staging.to(self.device))
            result, target_s = self.speculator.run_fused(sched)
            self.target_time_s += target_s
            return result
        layout = stage_batch(self._short_chunks_as_rows(sched.chunks), self.block_size, self.kernel_attention, staging)
        plain = [row for row in sched.samples if not row.spec_token_ids]
        spec = [row for row in sched.samples if row.spec_token_ids]
        expanded = Speculator.expand(spec)
        prompt_rows = stage_logit_rows(sched, layout, staging, [plain, spec])
        plain_plan = stage_sampling(plain, staging)
        spec_plan = stage_sampling(expanded, staging, "verify.sampling.")
        if spec:
            Speculator.stage_verify(spec, staging)
        views = staging.to(self.device)
        self._apply_block_maps(sched, views)
        meta = attention_metadata(layout, views, self.kernel_attention, self.block_size, self.windows, self.dtype)
        logits = self.model.step_logits(views["input_ids"], views["positions"], meta, views["logit_rows"])
        if logits is None:
            return ModelRunnerOutput()  # a tensor-parallel worker: rank 0 samples
        groups = []
        if plain:
            plain_meta = sampling_metadata(plain_plan, views, lambda r: self._generator(plain[r]))
            groups.append((plain, self.sampler(logits[: len(plain)], plain_meta)))
        if spec:
            spec_meta = sampling_metadata(spec_plan, views, lambda r: self._generator(expanded[r]))
            batch = self.speculator.verify_batch(spec, views, self._generator)
            groups.append((spec, rejection_sample(self.sampler, logits[len(plain) : len(plain) + len(expanded)], spec_meta, batch)))
        scored = score_prompt_tokens(logits[len(plain) + len(expanded) :], views.get("prompt_targets"), prompt_rows)
        result = fetch_results(groups, scored, prompt_rows)
        self.target_time_s += time.perf_counter() - started
        if self.speculator is not None:
            self.speculator.propose(sched, result, self.sampler, self._generator)
        return result

    def _short_chunks_as_rows(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """When all of a step's positions fit one fused step, its prompt chunks too are laid out as
        decode rows, each attending to the context up to its own position — what their prefill
        computes — so the step is one C call instead of a pass through the modules: the end of a
        prompt found in the prefix cache, or a short prompt, costs about a decode step."""
        if self.model.fused is None or not self.kernel_attention or sum(c.num_tokens for c in chunks) > MAX_ROWS:
            return chunks
        return [c if c.is_decode else replace(c, num_spec=c.num_tokens - 1) for c in chunks]

    @property
    def max_fused_spec_seqs(self) -> int:
        """The most sequences a fused speculation call takes (0: none)."""
        return self.speculator.max_fused_seqs if self.speculator is not None else 0

    @property
    def max_multi_step_rows(self) -> int:
        """The most sequences a multi-step call takes: the fused step's rows, or 0 without it."""
        return MAX_ROWS if self.model.fused is not None else 0

    def _greedy_steps(self, sched: SchedulerOutput, staging: Staging) -> ModelRunnerOutput:
        """Multi-step scheduling: `sched.num_steps` greedy steps of plain decodes in one fused
        call, each row's argmax its next input; every row gets num_steps tokens."""
        layout = stage_batch(sched.chunks, self.block_size, self.kernel_attention, staging, num_steps=sched.num_steps)
        stage_logit_rows(sched, layout, staging, [sched.samples])
        views = staging.to(self.device)
        self._apply_block_maps(sched, views)
        meta = attention_metadata(layout, views, self.kernel_attention, self.block_size, self.windows, self.dtype)
        if self.model.fused is None or not self.model.fused.accepts(meta, len(sched.chunks)):
            raise RuntimeError("a multi-step step reached a runner that cannot run it as one fused call")
        tokens, logprobs = self.model.fused.greedy_steps(views["input_ids"], views["positions"], meta, views["logit_rows"],
                                                         sched.num_steps)
        result = ModelRunnerOutput()
        for row, ids, values in zip(sched.samples, tokens.t().tolist(), logprobs.t().tolist()):
            ranked = row.params.logprobs == 0  # an argmax's rank is 1, and no alternatives were asked for
            result.sampled[row.seq_id] = [SampledToken(token, logprob, 1, []) if ranked else SampledToken(token, logprob)
                                          for token, logprob in zip(ids, values)]
        return result

    def _offload_step(self, sched: SchedulerOutput) -> SchedulerOutput:
        """Copy-on-write happens in the host pool; the step then sees its blocks renumbered."""
        if sched.blocks_to_copy:
            sources, destinations = zip(*sched.blocks_to_copy)
            self.kv_cache.copy(torch.tensor(sources), torch.tensor(destinations))
        return self.offload.plan(replace(sched, blocks_to_copy=[]))

    def _forget(self, seq_ids: list[int]) -> None:
        """Drop per-sequence state of sequences that finished."""
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
        if self.speculator is not None:
            self.speculator.forget(seq_ids)

    def _apply_block_maps(self, sched: SchedulerOutput, views: dict[str, torch.Tensor]) -> None:
        """Swap-outs first: the blocks they free may be reused by this step's swap-ins. A draft
        model's mirror pool moves with the target's."""
        for cache in self.kv_caches:
            if sched.blocks_to_swap_out:
                cache.swap_out(views["swap_out.device"], [host for _, host in sched.blocks_to_swap_out])
            if sched.blocks_to_swap_in:
                cache.swap_in([host for host, _ in sched.blocks_to_swap_in], views["swap_in.device"])
            if sched.blocks_to_copy:
                cache.copy(views["copy.pairs"][:, 0], views["copy.pairs"][:, 1])

    @property
    def kv_caches(self) -> list[KVCache]:
        return [self.kv_cache] + (self.speculator.kv_caches if self.speculator is not None else [])

    def _generator(self, row: SampleRow) -> torch.Generator:
        """A seeded sample's generator, made at its first token from (seed, sample index)."""
        generator = self.generators.get(row.seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed((row.params.seed * 1_000_003 + row.sample_index) % (1 << 63))
            self.generators[row.seq_id] = generator
        return generator


def kv_pool_sizes(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                  extra_bytes_per_block: int = 0, num_ranks: int = 1) -> tuple[int, int]:
    """(device blocks, host swap blocks) for one rank holding `model_config`'s part of each
    block. The default budget (a share of free memory) is split between the ranks of one host."""
    per_block = bytes_per_block(model_config, config.block_size, config.torch_dtype(model_config)) + extra_bytes_per_block
    most_useful = config.max_num_seqs * -(-max_model_len // config.block_size)  # more could never be used
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // (per_block * num_ranks)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is less than one KV block "
                             f"({per_block * num_ranks} bytes)")
    else:
        budget = int(available_memory_bytes() * config.kv_cache_memory_fraction) // (per_block * num_ranks)
        num_blocks = max(1, min(budget, most_useful))
    num_cpu_blocks = 0
    if config.preemption_mode == "swap":
        num_cpu_blocks = min(config.swap_space // (per_block * num_ranks), most_useful)
    return num_blocks, num_cpu_blocks


def _stage_block_maps(sched: SchedulerOutput, staging: Staging) -> None:
    if sched.blocks_to_swap_out:
        staging.add("swap_out.device", [device for device, _ in sched.blocks_to_swap_out])
    if sched.blocks_to_swap_in:
        staging.add("swap_in.device", [device for _, device in sched.blocks_to_swap_in])
    if sched.blocks_to_copy:
        staging.add("copy.pairs", sched.blocks_to_copy, shape=(len(sched.blocks_to_copy), 2))
