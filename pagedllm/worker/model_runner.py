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
from pagedllm.step.scheduler_output import SampleRow, ScheduledChunk, SchedulerOutput
from pagedllm.layers import kernels, triton_attention
from pagedllm.layers.paged_decode import kernel_supported, load
from pagedllm.layers.sampler import Sampler
from pagedllm.layers.small_matmul import MAX_ROWS
from pagedllm.models.fused_decode import FusedDecoder, unsupported as fused_unsupported
from pagedllm.models.loader import load_model
from pagedllm.spec_decode.rejection import rejection_sample
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from pagedllm.worker.gpu_memory import MemoryReading, kv_cache_budget
from pagedllm.worker.input_batch import BatchLayout, attention_metadata, stage_batch
from pagedllm.worker.kv_cache import KVCache, bytes_per_block, bytes_per_layer_block
from pagedllm.worker.kv_offload import LayerwiseKVOffload
from pagedllm.worker.malloc import keep_freed_memory
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
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
        self.windows = sorted(set(model_config.sliding_windows), key=lambda w: (w is not None, w or 0))
        self.sampler = Sampler(config.seed, self.device, kernels.load() if self.device.type == "cpu" else None)
        self.target_time_s = 0.0  # in execute() before proposing
        self.generators: dict[int, torch.Generator] = {}  # seq id -> a seeded sequence's own generator
        self.graphs: DecodeGraphs | None = None
        self.offload: LayerwiseKVOffload | None = None
        self.num_blocks, self.num_cpu_blocks = pool_sizes or self._pool_sizes()
        self.kv_cache = KVCache(self.model.config, self.num_blocks, self.num_cpu_blocks, self.block_size, self.dtype,
                                self.device, host_pool=config.kv_offload)
        self.offload = self._offload() if config.kv_offload else None
        for index, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(*(self.offload.buffer(0) if self.offload else self.kv_cache.layer(index)))
        self._set_attention_backend()
        if self.triton_attention and self.device.type == "cuda":  # (Triton's interpreter would only be slower)
            self.model.use_triton_ops()
        if fused_library is not None and self.kernel_attention:
            self.model.fused = FusedDecoder(self.model, fused_library)
        elif fused_library is not None:  # the attention kernel is off: the fused step cannot run
            if config.decode_backend == "fused":
                raise RuntimeError("decode_backend='fused' needs the C decode attention kernel, which is not in use")
            for linear in self.model.linears():
                linear.small = None
        if self.speculator is not None:
            self.speculator.allocate(self.num_blocks, self.num_cpu_blocks, self.kernel_attention, self.model.fused)
        self.graphs = self._capture_graphs()

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

    def _set_attention_backend(self) -> None:
        self.attention_backend = self._choose_attention_backend()
        self.kernel_attention = self.attention_backend == "kernel"
        self.triton_attention = self.attention_backend == "triton"

    def _choose_attention_backend(self) -> str:
        """'kernel': the C attention kernels, for fp32 on CPU when they build; 'triton': the Triton
        kernels, on CUDA; 'sdpa' where neither runs (auto) or when asked for."""
        backend = self.config.attention_backend
        if backend == "sdpa":
            return "sdpa"
        if backend == "triton" or (backend == "auto" and self.device.type == "cuda"):
            reason = triton_attention.unavailable_reason(self.device)
            if reason is not None and backend == "triton":
                raise ValueError(f"attention_backend='triton' cannot be used: {reason}")
            return "triton" if reason is None else "sdpa"
        k_cache = self.model.attention_layers()[0].k_cache  # the pool, or the offload buffer
        if backend == "auto" and not kernel_supported(k_cache):
            return "sdpa"
        if not kernel_supported(k_cache):
            raise ValueError(
                "attention_backend='kernel' needs float32 KV caches on the CPU and a head_dim that is a multiple "
                "of 8; use 'sdpa' or 'auto'"
            )
        if load() is not None:
            return "kernel"
        if backend == "kernel":
            raise RuntimeError("attention_backend='kernel' was asked for, but the kernel could not be built (see the log)")
        return "sdpa"

    def _capture_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for all-decode steps of dense models with the Triton kernels, unless
        enforce_eager (or tensor parallelism / KV offload, whose steps call out of the graph)."""
        if (self.config.enforce_eager or self.device.type != "cuda" or not self.triton_attention or self.group is not None
                or self.offload is not None or self.model_config.moe is not None):
            return None
        graphs = DecodeGraphs(self.model, capture_sizes(self.config.max_num_seqs), -(-self.max_model_len // self.block_size),
                              self.device)
        with torch.inference_mode():
            graphs.capture()
        return graphs

    def _graph_size(self, sched: SchedulerOutput) -> int | None:
        """The captured batch size a step of only decode rows is padded to; None: run eagerly."""
        if self.graphs is None or not all(chunk.is_decode for chunk in sched.chunks):
            return None
        return padded_size(sum(chunk.num_tokens for chunk in sched.chunks), self.graphs.sizes)

    def _pool_sizes(self) -> tuple[int, int]:
        extra = self.speculator.bytes_per_block() if self.speculator is not None else 0  # the draft's mirror pool
        budget = None
        if self.device.type == "cuda" and self.config.num_kv_blocks is None and self.config.kv_cache_memory is None:
            budget = self._profile_kv_budget()
        return kv_pool_sizes(self.config, self.model.config, self.max_model_len, extra, memory_budget=budget)

    def _profile_kv_budget(self) -> int:
        """Runs the largest step the scheduler can form against a scratch pool and sizes the
        real pool from the memory it left (worker/gpu_memory.py)."""
        tokens = self.config.resolve_max_num_batched_tokens(self.max_model_len)
        seqs = max(1, min(self.config.max_num_seqs, tokens))
        lengths = [min(tokens // seqs + (i < tokens % seqs), self.max_model_len) for i in range(seqs)]
        lengths = [n for n in lengths if n > 0]
        widths = [-(-n // self.block_size) for n in lengths]
        scratch = self.kv_cache = KVCache(self.model.config, sum(widths), 0, self.block_size, self.dtype, self.device)
        for index, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(*scratch.layer(index))
        self._set_attention_backend()
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=5, max_tokens=1)
        chunks, samples, first_block = [], [], 0
        for seq, (n, width) in enumerate(zip(lengths, widths)):
            ids = [(seq * 31 + i) % self.model_config.vocab_size for i in range(n)]
            chunks.append(ScheduledChunk(seq, 0, ids, list(range(first_block, first_block + width))))
            samples.append(SampleRow(seq, seq, params, 0, ids, n, frozenset()))
            first_block += width
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        speculator, self.speculator = self.speculator, None  # the draft's pools are not allocated yet
        try:
            self.execute(SchedulerOutput(chunks=chunks, samples=samples))
        finally:
            self.speculator = speculator
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reading = MemoryReading(total, free, torch.cuda.memory_reserved(self.device),
                                torch.cuda.max_memory_allocated(self.device), scratch.k.nbytes + scratch.v.nbytes)
        del scratch, self.kv_cache
        for attn in self.model.attention_layers():
            attn.bind_cache(torch.empty(0), torch.empty(0))
        torch.cuda.empty_cache()
        return kv_cache_budget(reading, self.config.gpu_memory_utilization)

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
        graph_size = self._graph_size(sched)
        pad_rows = graph_size - sum(chunk.num_tokens for chunk in sched.chunks) if graph_size else 0
        layout = stage_batch(self._short_chunks_as_rows(sched.chunks), self.block_size, self.kernel_attention, staging,
                             triton=self.triton_attention, pad_rows=pad_rows)
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
        logits = self._logits(layout, views, graph_size)
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

    def _logits(self, layout: BatchLayout, views: dict[str, torch.Tensor], graph_size: int | None) -> torch.Tensor | None:
        """The sampled rows' logits: the forward pass replayed from a CUDA graph, or run eagerly."""
        if graph_size is not None:
            hidden = self.graphs.replay(views, graph_size)
            return self.model.compute_logits(hidden.index_select(0, views["logit_rows"]))
        meta = attention_metadata(layout, views, self.kernel_attention, self.block_size, self.windows, self.dtype,
                                  triton=self.triton_attention)
        return self.model.step_logits(views["input_ids"], views["positions"], meta, views["logit_rows"])

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
                  extra_bytes_per_block: int = 0, num_ranks: int = 1, memory_budget: int | None = None) -> tuple[int, int]:
    """(device blocks, host swap blocks) for one rank holding `model_config`'s part of each
    block. The default budget (a share of free memory) is split between the ranks of one host;
    `memory_budget`: bytes measured for the pool (a GPU's, worker/gpu_memory.py)."""
    per_block = bytes_per_block(model_config, config.block_size, config.torch_dtype(model_config)) + extra_bytes_per_block
    most_useful = config.max_num_seqs * -(-max_model_len // config.block_size)  # more could never be used
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // (per_block * num_ranks)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is less than one KV block "
                             f"({per_block * num_ranks} bytes)")
    elif memory_budget is not None:
        if memory_budget < per_block:
            raise ValueError(f"the GPU memory left for the KV cache ({memory_budget} bytes) is less than one KV block "
                             f"({per_block} bytes); raise gpu_memory_utilization or pass kv_cache_memory")
        num_blocks = min(memory_budget // per_block, most_useful)
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
