"""Model runner: turns a scheduler step into a forward pass (or a burst of them) and the samples it yields.

It owns the model (with the fused decode step attached for small all-decode steps on CPU,
models/fused_decode.py), the KV pool, the per-sequence sampling generators and what it keeps of
each sequence between steps (worker/sequence_state.py), and sees only the step's plain metadata
(`SchedulerOutput`), never request state. For each step it applies the step's changes to its
sequences, the swap and copy-on-write maps, stages the flat batch (worker/input_batch.py) and
the sampling parameters (worker/sampling_inputs.py) in one transfer per dtype, runs the forward
pass, samples on the device and reads the results back in one copy (worker/step_results.py).
`launch` returns as soon as the step is queued on the device, its results still on their way
(async scheduling: the engine works on the previous step meanwhile); a step's inputs may then
name tokens the step before sampled (`PENDING_TOKEN`), which are copied into place on the device.
How a step's token budgets are filled — one forward pass, greedy steps in one fused call,
speculation cycles — and which backends run it are the planner's decisions (step/planner.py);
speculation itself is a speculator the runner is given (spec_decode/speculator.py).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.config import EngineConfig, ModelConfig, available_memory_bytes
from pagedllm.distributed.group import ParallelGroup
from pagedllm.layers import kernels
from pagedllm.layers.sampler import Sampler
from pagedllm.lora.fused import fused_lora
from pagedllm.lora.manager import LoRAManager, pair_dtype
from pagedllm.lora.request import LoRARequest
from pagedllm.models.fused_decode import FusedDecoder, GreedyRows, RowDraws
from pagedllm.models.loader import load_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.step.planner import StepKind, StepPlanner
from pagedllm.step.runner_output import ModelRunnerOutput, SampledToken
from pagedllm.step.scheduler_output import PENDING_TOKEN, NewSequence, ScheduledChunk, SchedulerOutput
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from pagedllm.worker.gpu_memory import MemoryReading, kv_cache_budget
from pagedllm.worker.input_batch import BatchChunk, BatchLayout, attention_metadata, stage_batch
from pagedllm.worker.kv_cache import KVCache, bytes_per_block, bytes_per_layer_block
from pagedllm.worker.kv_offload import LayerwiseKVOffload
from pagedllm.worker.malloc import keep_freed_memory, release_freed_memory
from pagedllm.worker.pooler import pool
from pagedllm.worker.sampling_inputs import NO_TOP_K, SampleRow, sampling_metadata, stage_sampling
from pagedllm.worker.sequence_state import SequenceStates
from pagedllm.worker.staging import Staging
from pagedllm.worker.step_results import (PackedResults, ReadyResults, StepResults, pack_results, score_prompt_tokens,
                                          stage_logit_rows)

if TYPE_CHECKING:  # the engine gives the runner its speculator; spec_decode builds on this package
    from pagedllm.spec_decode.speculator import Speculator


class ModelRunner:
    """Under tensor parallelism there is one runner per rank (`group`), each with its part of the
    model and of every KV block, all given the same `pool_sizes`; only rank 0 samples.
    `planner`: the engine's (else decided here from the config); `speculator`: speculative
    decoding's side of each step, when the engine speculates."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 group: ParallelGroup | None = None, pool_sizes: tuple[int, int] | None = None,
                 planner: StepPlanner | None = None, speculator: "Speculator | None" = None):
        self.config = config
        self.model_config = model_config
        self.group = group
        self.planner = planner = planner or StepPlanner.decide(config, model_config, max_model_len)
        self.device = config.torch_device(group.rank if group is not None else 0)
        self.dtype = config.torch_dtype(model_config)
        self.kv_dtype = config.kv_torch_dtype(model_config)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cpu":
            keep_freed_memory()
        panels_library = kernels.load() if planner.small_matmul_panels else None
        self.model = load_model(model_config, max_model_len, self.dtype, self.device, group, quantization=config.quantization,
                                panel_width=panels_library.panel_width() if panels_library is not None else None)
        # Block-quantized panels multiply int8-quantized activations (small_matmul.c) in every
        # step, prompts included; pooled embeddings keep fp32 (_set_int8)
        self.int8_activations = bool(config.int8_activations)
        self._int8_now: bool | None = None
        self._set_int8(self.int8_activations)
        self.speculator = speculator
        self.states = SequenceStates()
        self.windows = sorted(set(model_config.sliding_windows), key=lambda w: (w is not None, w or 0))
        self.sampler = Sampler(config.seed, self.device, kernels.load() if self.device.type == "cpu" else None)
        self.generators: dict[int, torch.Generator] = {}  # seq id -> a seeded sequence's own generator
        # Async scheduling: the last step's final samples on the device (one per sample row), and
        # each sampled sequence's row in them, for the next step's placeholder inputs
        self._last_samples: tuple[torch.Tensor, dict[int, int]] | None = None
        self.graphs: DecodeGraphs | None = None
        self.offload: LayerwiseKVOffload | None = None
        self.num_blocks, self.num_cpu_blocks = pool_sizes or self._pool_sizes()
        self.kv_cache = KVCache(self.model.config, self.num_blocks, self.num_cpu_blocks, self.block_size, self.kv_dtype,
                                self.device, host_pool=planner.kv_offload)
        self.offload = self._offload() if planner.kv_offload else None
        for index, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(*(self.offload.buffer(0) if self.offload else self.kv_cache.layer(index)))
        # LoRA adapters (lora/manager.py): sites on the projections, the adapter of each sequence
        self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, self.device, self.dtype,
                                pair_dtype(config.lora_dtype, self.dtype, self.device.type)) if config.enable_lora else None
        self.lora_of: dict[int, LoRARequest] = {}
        self.fuse_lora = True  # adapter rows in the fused C step (False: always the modules, the reference)
        if self.triton_attention and self.device.type == "cuda":  # (Triton's interpreter would only be slower)
            self.model.use_triton_ops()
        if planner.fused_decode:
            self.model.fused = FusedDecoder(self.model, panels_library)
        elif panels_library is not None:  # panels only for the blocks they keep (the fused step does not run)
            for linear in self.model.linears():
                if linear.library is None:  # kept blocks are the weight itself
                    linear.small = None
        if self.speculator is not None:
            self.speculator.allocate(self.num_blocks, self.num_cpu_blocks, self.model.fused)
        self.graphs = self._capture_graphs()
        if self.device.type == "cpu":
            release_freed_memory()  # the load's temporaries (malloc.py)

    @property
    def attention_backend(self) -> str:
        return self.planner.attention_backend

    @property
    def kernel_attention(self) -> bool:
        return self.planner.kernel_attention

    @property
    def triton_attention(self) -> bool:
        return self.planner.attention_backend == "triton"

    def _offload(self) -> LayerwiseKVOffload:
        per_layer_block = bytes_per_layer_block(self.model.config, self.block_size, self.kv_dtype)
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

    def _capture_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for all-decode steps, where the planner uses them (dense models with the
        Triton kernels, unless enforce_eager, tensor parallelism or KV offload)."""
        if not self.planner.cuda_graphs:
            return None
        graphs = DecodeGraphs(self.model, capture_sizes(self.config.max_num_seqs), -(-self.max_model_len // self.block_size),
                              self.device)
        with torch.inference_mode():
            graphs.capture()
        return graphs

    def _graph_size(self, chunks: list[BatchChunk]) -> int | None:
        """The captured batch size a step of only decode rows is padded to; None: run eagerly."""
        if self.graphs is None or not all(chunk.is_decode for chunk in chunks) or self._uses_adapters(chunks):
            return None  # (a graph replays the base model only)
        return padded_size(sum(chunk.num_tokens for chunk in chunks), self.graphs.sizes)

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
        scratch = self.kv_cache = KVCache(self.model.config, sum(widths), 0, self.block_size, self.kv_dtype, self.device)
        for index, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(*scratch.layer(index))
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=5, max_tokens=1)
        step, first_block = SchedulerOutput(), 0
        for seq, (n, width) in enumerate(zip(lengths, widths)):
            ids = [(seq * 31 + i) % self.model_config.vocab_size for i in range(n)]
            step.new_seqs.append(NewSequence(seq, ids, n, params, 0, frozenset(), list(range(first_block, first_block + width)), 0))
            step.chunks.append(ScheduledChunk(seq, n))
            first_block += width
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        speculator, self.speculator = self.speculator, None  # the draft's pools are not allocated yet
        try:
            self.execute(step)
        finally:
            self.speculator = speculator
            self.states.clear()
            self.generators.clear()
            self._last_samples = None
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
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step and wait for its results."""
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepResults:
        """Queue a step on the device; its results come when asked for (a step that speculates,
        or runs as a fused C call, has them already)."""
        started = time.perf_counter()
        self._apply(sched)
        chunks = [self._batch_chunk(chunk) for chunk in sched.chunks]
        rows = self._sample_rows(sched, chunks)
        if self.offload is not None:
            sched, chunks = self._offload_step(sched, chunks)
        staging = Staging()
        _stage_block_maps(sched, staging)
        if not chunks:
            self._apply_block_maps(sched, staging.to(self.device))
            return ReadyResults(ModelRunnerOutput())
        first = sched.chunks[0]  # a burst gives every chunk the same budget
        kind = self.planner.step_kind(first.token_budget, first.max_proposals, sched.greedy_burst)
        if kind is StepKind.GREEDY_STEPS:
            return self._greedy_steps(sched, chunks, rows, staging, first.token_budget)
        if kind is StepKind.SPEC_CYCLES:
            self._apply_block_maps(sched, staging.to(self.device))
            return ReadyResults(self.speculator.run_fused(chunks, rows, first.token_budget))
        pending = self._forward(sched, chunks, rows, staging)
        if pending is None:
            return ReadyResults(ModelRunnerOutput())  # a tensor-parallel worker
        if self.speculator is None:
            return pending
        result = pending.result()
        self.speculator.target_time_s += time.perf_counter() - started
        self.speculator.propose(chunks, rows, [chunk.max_proposals for chunk in sched.chunks], result, self.sampler,
                                self._generator)
        return ReadyResults(result)

    def _set_int8(self, on: bool) -> None:
        """int8 activations in every block-quantized matmul (every step when the engine has them:
        llama.cpp's arithmetic), or fp32 (the exact path, and pooled embeddings: `embed`).
        Rounding a row to int8 magnifies any last-bit difference in its input, so prompts never
        take the fused step's own arithmetic (the planner's `prompt_rows_fused`)."""
        if on == self._int8_now:
            return
        for linear in self.model.linears():
            if linear.small is not None:
                linear.small.int8_activations = on
        if self.model.fused is not None:
            self.model.fused.set_int8_activations(on)
        self._int8_now = on

    def embed(self, token_lists: list[list[int]], max_batch_tokens: int, normalize: bool = True) -> list[list[float]]:
        """Each prompt's pooled embedding (worker/pooler.py), between steps: the modules in fp32
        activations, as a prompt step runs them, and nothing of the KV pool or of the layer-wise
        offload touched (their hook is off for the pass)."""
        self._set_int8(False)
        inner = self.model.model
        hook, inner.layer_hook = inner.layer_hook, None
        try:
            return pool(self.model, token_lists, self.windows, self.dtype, self.device, max_batch_tokens, normalize)
        finally:
            inner.layer_hook = hook
            self._set_int8(self.int8_activations)

    def abandon_steps(self) -> None:
        """A step failed and the engine gave up the steps in flight (LLMEngine.step): no later
        step's inputs come from their samples. (The sequences they computed are ended, and the
        next step's finished ids drop them.)"""
        self._last_samples = None

    def _batch_chunk(self, chunk: ScheduledChunk) -> BatchChunk:
        """A scheduled chunk's tokens (its proposals to verify are the speculator's)."""
        return self.states.batch_chunk(chunk, self.speculator.proposals(chunk.seq_id) if self.speculator is not None else [])

    def _sample_rows(self, sched: SchedulerOutput, chunks: list[BatchChunk]) -> list[SampleRow]:
        """A row for each chunk that ends with a token to sample (with the proposals it verifies),
        each followed by the samples forked from it this step, which sample from the same row."""
        forks: dict[int, list[int]] = {}
        for seq in sched.new_seqs:
            if seq.forked_from is not None:
                forks.setdefault(seq.forked_from, []).append(seq.seq_id)
        rows = []
        for index, (scheduled, chunk) in enumerate(zip(sched.chunks, chunks)):
            if scheduled.token_budget:
                proposals = chunk.token_ids[chunk.num_tokens - chunk.num_spec :]
                rows.append(self.states.sample_row(chunk.seq_id, index, proposals, sched.allowed_tokens.get(chunk.seq_id)))
            for child in forks.get(chunk.seq_id, ()):
                rows.append(self.states.sample_row(child, index, [], sched.allowed_tokens.get(child)))
        return rows

    def _forward(self, sched: SchedulerOutput, chunks: list[BatchChunk], rows: list[SampleRow],
                 staging: Staging) -> StepResults | None:
        """One forward pass and its samples: plain rows, then rows verifying proposals, then the
        prompt positions whose logprobs were asked for. None on a tensor-parallel worker."""
        graph_size = self._graph_size(chunks)
        pad_rows = graph_size - sum(chunk.num_tokens for chunk in chunks) if graph_size else 0
        layout = stage_batch(self._short_chunks_as_rows(chunks), self.block_size, self.kernel_attention, staging,
                             triton=self.triton_attention, pad_rows=pad_rows)
        plain = [row for row in rows if not row.spec_token_ids]
        spec = [row for row in rows if row.spec_token_ids]
        expanded = self.speculator.expand(spec) if spec else []
        prompt_rows = stage_logit_rows(chunks, layout, staging, [plain, spec])
        plain_plan = stage_sampling(plain, staging)
        spec_plan = stage_sampling(expanded, staging, "verify.sampling.")
        if spec:
            self.speculator.stage_verify(spec, staging)
        self._stage_pending_inputs(chunks, layout, staging, plain if plain_plan.penalised else None)
        views = staging.to(self.device)
        self._fill_pending_inputs(views)
        self._apply_block_maps(sched, views)
        self._set_adapter_rows(chunks, layout)
        try:
            logits = self._logits(layout, views, graph_size)
        finally:
            if self.lora is not None:
                self.lora.set_rows([])
        if logits is None:
            return None  # a tensor-parallel worker: rank 0 samples
        groups = []
        if plain:
            plain_meta = sampling_metadata(plain_plan, views, lambda r: self._generator(plain[r]))
            groups.append((plain, self.sampler(logits[: len(plain)], plain_meta)))
        if spec:
            spec_meta = sampling_metadata(spec_plan, views, lambda r: self._generator(expanded[r]))
            batch = self.speculator.verify_batch(spec, views, self._generator)
            verified = self.speculator.sample_verified(self.sampler, logits[len(plain) : len(plain) + len(expanded)], spec_meta, batch)
            groups.append((spec, verified))
        scored = score_prompt_tokens(logits[len(plain) + len(expanded) :], views.get("prompt_targets"), prompt_rows)
        if plain:
            self._keep_last_samples(plain, groups[0][1].token_ids)
        return self._patching_history(pack_results(groups, scored, prompt_rows), rows)

    def _logits(self, layout: BatchLayout, views: dict[str, torch.Tensor], graph_size: int | None) -> torch.Tensor | None:
        """The sampled rows' logits: the forward pass replayed from a CUDA graph, or run (as one
        fused C call when the planner says it can) eagerly."""
        if graph_size is not None:
            hidden = self.graphs.replay(views, graph_size)
            return self.model.compute_logits(hidden.index_select(0, views["logit_rows"]))
        meta = attention_metadata(layout, views, self.kernel_attention, self.block_size, self.windows, self.dtype,
                                  triton=self.triton_attention)
        ids = views["input_ids"]
        fused = self.planner.runs_fused(self.model.fused, meta, ids.shape[0])
        lora = None
        if self.lora is not None and self.lora.step.groups:
            # the fused C step adds the adapter rows' deltas (lora/fused.py), else the modules do
            described = fused_lora(self.model, self.lora.step.groups, ids.shape[0]) if fused and self.fuse_lora else None
            fused = described is not None
            lora = described[0] if fused else None
        return self.model.step_logits(ids, views["positions"], meta, views["logit_rows"], fused, lora)

    def _uses_adapters(self, chunks: list[BatchChunk]) -> bool:
        return bool(self.lora_of) and any(chunk.seq_id in self.lora_of for chunk in chunks)

    def _set_adapter_rows(self, chunks: list[BatchChunk], layout: BatchLayout) -> None:
        """Tell the LoRA sites which rows of this step use which adapter (each chunk's rows are
        consecutive; an adapter's rows are one slice when they are, else an index tensor)."""
        if self.lora is None or not self._uses_adapters(chunks):
            return
        ranges: dict[int, list[tuple[int, int]]] = {}
        for index, chunk in enumerate(chunks):
            request = self.lora_of.get(chunk.seq_id)
            if request is not None:
                ranges.setdefault(request.lora_int_id, []).append((layout.first_rows[index], layout.last_rows[index] + 1))
        requests = {self.lora_of[c.seq_id].lora_int_id: self.lora_of[c.seq_id] for c in chunks if c.seq_id in self.lora_of}
        weights = self.lora.activate(list(requests.values()))
        groups = []
        for lora_int_id, spans in ranges.items():
            spans.sort()
            if all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
                rows = slice(spans[0][0], spans[-1][1])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.device)
            groups.append((weights[lora_int_id], rows))
        self.lora.set_rows(groups)

    def _short_chunks_as_rows(self, chunks: list[BatchChunk]) -> list[BatchChunk]:
        """When the planner says all of a step's positions fit one fused step, its prompt chunks
        too are laid out as decode rows: the end of a prompt found in the prefix cache, or a short
        prompt, costs about a decode step (not with int8 activations: the planner's
        `prompt_rows_fused`; split that way, a prompt's first-token logprobs moved by 0.15-0.20
        nats on the default model's chat prompts)."""
        if not self.planner.decode_rows_fit(sum(c.num_tokens for c in chunks)):
            return chunks
        return [c if c.is_decode else replace(c, num_spec=c.num_tokens - 1) for c in chunks]

    def _greedy_steps(self, sched: SchedulerOutput, chunks: list[BatchChunk], rows: list[SampleRow], staging: Staging,
                      num_steps: int) -> StepResults:
        """A burst: `num_steps` steps of plain decodes (one without multi-step scheduling), each
        row's token its next input; every row gets num_steps tokens. On CPU one fused C call, which
        reads the staged host arrays and draws the random rows' tokens itself (_burst_draws);
        elsewhere greedy steps back to back on the device (_device_greedy_steps)."""
        if not self.planner.fused_decode:
            if any(not row.params.greedy for row in rows):
                raise RuntimeError("a burst with random rows reached a runner without the fused decode step")
            tokens, logprobs = self._device_greedy_steps(sched, chunks, rows, staging, num_steps)
            self._keep_last_samples(rows, tokens[-1])
            return self._patching_history(_greedy_results(rows, tokens, logprobs), rows)
        layout = stage_batch(chunks, self.block_size, self.kernel_attention, staging, num_steps=num_steps)
        stage_logit_rows(chunks, layout, staging, [rows])
        if not self.model.fused.fits(self.kernel_attention, len(layout.prefills), len(layout.buckets), len(chunks)):
            raise RuntimeError("a greedy burst reached a runner that cannot run it as one fused call")
        if _moves_blocks(sched):
            self._apply_block_maps(sched, staging.to(self.device))
        host = staging.host()  # the C call reads the host arrays themselves (CPU only: no transfer)
        tokens, logprobs = self.model.fused.decode_steps(GreedyRows(
            host["input_ids"], host["positions"], host["slot_mapping"], host["decode0.ctx_lens"], host["decode0.tables"],
            host["logit_rows"]), num_steps, self._burst_draws(rows, num_steps))
        return ReadyResults(_greedy_output(rows, tokens.T.tolist(), logprobs.T.tolist()))

    def _burst_draws(self, rows: list[SampleRow], num_steps: int) -> RowDraws | None:
        """How a burst's random rows draw (None: every row greedy): each one's 1 / temperature and
        min_p as the sampler takes them, and one uniform number a step from the generator the
        sampler would use — a seeded row's own, the unseeded rows' the engine's, step by step —
        so a burst draws the tokens single steps would."""
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random:
            return None
        uniform = np.zeros((num_steps, len(rows)))
        unseeded = [i for i in random if rows[i].params.seed is None]
        if unseeded:
            drawn = torch.rand(num_steps, len(unseeded), dtype=torch.float64, device=self.device, generator=self.sampler.generator)
            uniform[:, unseeded] = drawn.numpy()
        for i in random:
            if rows[i].params.seed is not None:
                generator = self._generator(rows[i])
                uniform[:, i] = torch.rand(num_steps, dtype=torch.float64, device=self.device, generator=generator).numpy()
        params = [row.params for row in rows]
        temperature = np.array([1.0 if p.greedy else p.temperature for p in params], dtype=np.float32)
        inverse = np.where([p.greedy for p in params], np.float32(0.0), np.reciprocal(temperature)).astype(np.float32)
        draws = RowDraws(inverse, temperature, np.array([p.min_p for p in params], dtype=np.float32), uniform)
        if any(p.top_k != -1 or p.top_p < 1.0 for p in params if not p.greedy):
            draws.top_k = np.array([p.top_k if p.top_k != -1 and not p.greedy else NO_TOP_K for p in params], dtype=np.int64)
            draws.top_p = np.array([1.0 if p.greedy else p.top_p for p in params], dtype=np.float32)
        return draws

    def _device_greedy_steps(self, sched: SchedulerOutput, chunks: list[BatchChunk], rows: list[SampleRow],
                             staging: Staging, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`num_steps` forward passes (replayed from a CUDA graph where one is captured) with
        nothing between them on the host: each step's argmax is written into the next step's
        input ids on the device, and the positions, context lengths and slots advance there too
        (the staged block tables already cover the burst's positions); the tokens come back in
        one device-to-host copy after the step. Why: a GPU decode step is shorter than the engine's
        Python around it (scheduling, the step's arrays, output processing), so one step per
        engine step leaves the GPU idle most of the time (vLLM's multi-step scheduling)."""
        graph_size = self._graph_size(chunks)
        pad_rows = graph_size - len(chunks) if graph_size else 0
        layout = stage_batch(chunks, self.block_size, self.kernel_attention, staging, num_steps=num_steps,
                             triton=self.triton_attention, pad_rows=pad_rows)
        stage_logit_rows(chunks, layout, staging, [rows])
        self._stage_pending_inputs(chunks, layout, staging)
        views = staging.to(self.device)
        self._fill_pending_inputs(views)
        self._apply_block_maps(sched, views)
        real = len(chunks)  # decode rows 0 .. real - 1 (the padding after them)
        logit_rows = views["logit_rows"]
        tokens = torch.empty(num_steps, len(rows), dtype=torch.int64, device=self.device)
        logprobs = torch.empty(num_steps, len(rows), dtype=torch.float32, device=self.device)
        for step in range(num_steps):
            logits = self._logits(layout, views, graph_size).float()
            best = logits.argmax(dim=-1)  # the sampler's greedy choice
            tokens[step] = best
            # its logprob as the sampler's greedy path takes it, without a log-softmax of the vocabulary
            logprobs[step] = logits.gather(1, best[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
            if step + 1 < num_steps:
                views["input_ids"].index_copy_(0, logit_rows, tokens[step])
                self._advance_decodes(layout, views, real)
        return tokens, logprobs

    def _stage_pending_inputs(self, chunks: list[BatchChunk], layout: BatchLayout, staging: Staging,
                              penalised: list[SampleRow] | None = None) -> None:
        """Async scheduling: the rows whose input is a token the step before sampled, still a
        placeholder here (only a decode's last token can be one: older ones were replaced when
        their step's results came back, `_patching_history`), and where it is among that step's
        samples; with `penalised` (the sample rows whose penalties were staged), each row's
        source too, for the placeholder among its penalised tokens."""
        if not self.planner.async_scheduling:
            return
        rows, sources = [], {}
        for index, chunk in enumerate(chunks):
            if chunk.token_ids and chunk.token_ids[-1] == PENDING_TOKEN:
                if self._last_samples is None or chunk.seq_id not in self._last_samples[1]:
                    raise RuntimeError(f"sequence {chunk.seq_id}'s input token was not sampled by the step before")
                rows.append(layout.last_rows[index])
                sources[chunk.seq_id] = self._last_samples[1][chunk.seq_id]
        if rows:
            staging.add("pending.rows", rows)
            staging.add("pending.sources", list(sources.values()))
            if penalised is not None:
                staging.add("pending.row_sources", [sources.get(row.seq_id, 0) for row in penalised])

    def _fill_pending_inputs(self, views: dict[str, torch.Tensor]) -> None:
        """The placeholders' tokens copied into place on the device: the inputs, and the
        penalised tokens (prompt and output for repetition, output for presence and frequency)."""
        if "pending.rows" in views:
            last = self._last_samples[0]
            samples = last.index_select(0, views["pending.sources"])
            views["input_ids"].index_copy_(0, views["pending.rows"], samples.to(views["input_ids"].dtype))
            for name in ("sampling.seen", "sampling.output"):
                pairs = views.get(name)
                if pairs is not None and "pending.row_sources" in views:
                    tokens = last.index_select(0, views["pending.row_sources"].index_select(0, pairs[:, 0]))
                    pairs[:, 1] = torch.where(pairs[:, 1] < 0, tokens.to(pairs.dtype), pairs[:, 1])
        self._last_samples = None

    def _patching_history(self, results: StepResults, rows: list[SampleRow]) -> StepResults:
        """Async scheduling: when the step's tokens reach the host, they replace the placeholders
        the runner's copy of each sequence was given for them meanwhile (penalties read it)."""
        if not self.planner.async_scheduling:
            return results
        return _HistoryPatch(results, self.states, {row.seq_id: len(row.token_ids) for row in rows})

    def _keep_last_samples(self, rows: list[SampleRow], tokens: torch.Tensor) -> None:
        """The step's final token of each sample row, on the device, for the next step's inputs."""
        if self.planner.async_scheduling:
            self._last_samples = (tokens, {row.seq_id: index for index, row in enumerate(rows)})

    def _advance_decodes(self, layout: BatchLayout, views: dict[str, torch.Tensor], real: int) -> None:
        """Every real decode row one position on: its position and context length, and the slot
        its next token's KV goes to, from its (bucket's) block table."""
        positions, slots = views["positions"], views["slot_mapping"]
        positions[:real] += 1
        for number, bucket in enumerate(layout.buckets):
            count = min(bucket.count, real - bucket.start)
            if count <= 0:
                continue
            views[f"decode{number}.ctx_lens"][:count] += 1
            pos = positions[bucket.start : bucket.start + count]
            table = views[f"decode{number}.tables"][:count]
            block = table.gather(1, (pos // self.block_size)[:, None]).squeeze(1)
            slots[bucket.start : bucket.start + count] = block * self.block_size + pos % self.block_size

    def _offload_step(self, sched: SchedulerOutput, chunks: list[BatchChunk]) -> tuple[SchedulerOutput, list[BatchChunk]]:
        """Zeroing (secure mode) and copy-on-write happen in the host pool, in that order; the
        step then sees its blocks renumbered."""
        if sched.blocks_to_zero:
            self.kv_cache.zero(torch.tensor(sched.blocks_to_zero))
        if sched.blocks_to_copy:
            sources, destinations = zip(*sched.blocks_to_copy)
            self.kv_cache.copy(torch.tensor(sources), torch.tensor(destinations))
        return replace(sched, blocks_to_copy=[], blocks_to_zero=[]), self.offload.plan(chunks)

    def _apply(self, sched: SchedulerOutput) -> None:
        """The step's changes to the sequences held; a finished sequence's generator goes too (a
        preempted one keeps it, so its samples go on where they were)."""
        self.states.apply(sched)
        for seq in sched.new_seqs:
            if seq.lora is not None:
                self.lora_of[seq.seq_id] = seq.lora
        for seq_id in sched.finished_seq_ids:
            self.generators.pop(seq_id, None)
            self.lora_of.pop(seq_id, None)
        if self.speculator is not None:
            self.speculator.apply(sched)

    def _apply_block_maps(self, sched: SchedulerOutput, views: dict[str, torch.Tensor]) -> None:
        """Swap-outs first: the blocks they free may be reused by this step's swap-ins. Secure
        mode's zeroing comes after the swap-outs have read the blocks they free and before
        anything is written (swap-ins, copies, the step's tokens); host blocks are zeroed after
        the swap-ins have read them. A draft model's mirror pool moves with the target's."""
        for cache in self.kv_caches:
            if sched.blocks_to_swap_out:
                cache.swap_out(views["swap_out.device"], [host for _, host in sched.blocks_to_swap_out])
            if sched.blocks_to_zero:
                cache.zero(views["zero.device"])
            if sched.blocks_to_swap_in:
                cache.swap_in([host for host, _ in sched.blocks_to_swap_in], views["swap_in.device"])
            if sched.blocks_to_copy:
                cache.copy(views["copy.pairs"][:, 0], views["copy.pairs"][:, 1])
            if sched.host_blocks_to_zero:
                cache.zero_host(sched.host_blocks_to_zero)

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


DEFAULT_FREE_MEMORY_CAP = 0.25  # the default pool never takes more of the free memory than this


def one_context_blocks(config: EngineConfig, max_model_len: int) -> int:
    """The default pool (no size given, CPU): one full context, or one step's tokens if more,
    shared by every running sequence (llama.cpp's n_ctx). A 135M model's 8,192 positions hold
    0.75 GB in float32, where a quarter of free memory was 5-7 GB that nothing used."""
    tokens = max(max_model_len, config.resolve_max_num_batched_tokens(max_model_len))
    return -(-tokens // config.block_size)


def kv_pool_sizes(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                  extra_bytes_per_block: int = 0, num_ranks: int = 1, memory_budget: int | None = None) -> tuple[int, int]:
    """(device blocks, host swap blocks) for one rank holding `model_config`'s part of each
    block. The default budget (one context, capped by a share of free memory) is split between the ranks of one host;
    `memory_budget`: bytes measured for the pool (a GPU's, worker/gpu_memory.py)."""
    per_block = bytes_per_block(model_config, config.block_size, config.kv_torch_dtype(model_config)) + extra_bytes_per_block
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
        fraction = config.kv_cache_memory_fraction
        budget = int(available_memory_bytes() * (fraction or DEFAULT_FREE_MEMORY_CAP)) // (per_block * num_ranks)
        wanted = most_useful if fraction is not None else one_context_blocks(config, max_model_len)
        num_blocks = max(1, min(budget, wanted, most_useful))
    num_cpu_blocks = 0
    if config.preemption_mode == "swap":
        num_cpu_blocks = min(config.swap_space // (per_block * num_ranks), most_useful)
    return num_blocks, num_cpu_blocks


def _moves_blocks(sched: SchedulerOutput) -> bool:
    """Whether the step swaps, copies or zeroes KV blocks before it runs (_apply_block_maps)."""
    return bool(sched.blocks_to_swap_out or sched.blocks_to_swap_in or sched.blocks_to_copy or sched.blocks_to_zero
                or sched.host_blocks_to_zero)


def _stage_block_maps(sched: SchedulerOutput, staging: Staging) -> None:
    if sched.blocks_to_swap_out:
        staging.add("swap_out.device", [device for device, _ in sched.blocks_to_swap_out])
    if sched.blocks_to_swap_in:
        staging.add("swap_in.device", [device for _, device in sched.blocks_to_swap_in])
    if sched.blocks_to_copy:
        staging.add("copy.pairs", sched.blocks_to_copy, shape=(len(sched.blocks_to_copy), 2))
    if sched.blocks_to_zero:
        staging.add("zero.device", sched.blocks_to_zero)


class _HistoryPatch:
    """A step's results that, when taken, write its tokens over the placeholders for them in the
    runner's sequences (from `starts[seq]`, the index of the step's first token)."""

    def __init__(self, results: StepResults, states: SequenceStates, starts: dict[int, int]):
        self.results, self.states, self.starts = results, states, starts

    def result(self) -> ModelRunnerOutput:
        output = self.results.result()
        for seq_id, tokens in output.sampled.items():
            state, start = self.states.get(seq_id), self.starts.get(seq_id)
            if state is None or start is None:
                continue
            history = state.token_ids
            for index, token in enumerate(tokens, start):
                if index < len(history) and history[index] == PENDING_TOKEN:
                    history[index] = token.token_id
        return output


def _greedy_results(rows: list[SampleRow], tokens: torch.Tensor, logprobs: torch.Tensor) -> StepResults:
    """A burst's tokens and their logprobs ([num_steps, rows]), packed for one copy to the host."""
    steps = tokens.shape[0]
    packed = torch.cat([tokens.t().reshape(-1).double(), logprobs.t().reshape(-1).double()])

    def unpack(values: list[float]) -> ModelRunnerOutput:
        half = len(values) // 2
        ids = [[int(v) for v in values[r * steps : (r + 1) * steps]] for r in range(len(rows))]
        lps = [values[half + r * steps : half + (r + 1) * steps] for r in range(len(rows))]
        return _greedy_output(rows, ids, lps)

    return PackedResults(packed, unpack)


def _greedy_output(rows: list[SampleRow], tokens: list[list[int]], logprobs: list[list[float]]) -> ModelRunnerOutput:
    """A burst's tokens and their logprobs (per row, per step) as each row's sampled tokens."""
    result = ModelRunnerOutput()
    for row, ids, values in zip(rows, tokens, logprobs):
        ranked = row.params.logprobs == 0  # an argmax's rank is 1, and no alternatives were asked for
        result.sampled[row.seq_id] = [SampledToken(token, logprob, 1, []) if ranked else SampledToken(token, logprob)
                                      for token, logprob in zip(ids, values)]
    return result
