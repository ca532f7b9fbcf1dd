"""Model runner: turns a scheduler step into one forward pass and the samples it yields.

It owns the model and the KV pool. For each step it builds the flat batch (decodes first, then
prefill chunks): input ids, positions, the slot each new token's K/V goes to, block tables and
context lengths (as `AttentionMetadata`), applies the step's swap and copy-on-write maps, runs
the forward pass, and samples from the rows that end a sequence's known context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig, ModelConfig, available_memory_bytes
from pagedllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.layers.attention import AttentionMetadata, DecodeBucket, PrefillChunk, additive_mask, allowed_keys
from pagedllm.layers.paged_decode import kernel_supported, load
from pagedllm.layers.sampler import SampleResult, Sampler, top_logprobs
from pagedllm.models.loader import load_model
from pagedllm.worker.kv_cache import KVCache, bytes_per_block
from pagedllm.worker.malloc import keep_freed_memory


# How decodes are cut into SDPA calls: at most 4, a new one where padding would double the KV
# gathered. The C kernel reads only each context's own blocks, so it takes all decodes at once.
SDPA_DECODE_BUCKETS = (4, 2)
KERNEL_DECODE_BUCKETS = (1, 0)


@dataclass
class SampleRequest:
    """Sample a token for `seq` from the logits of `source`'s last scheduled token
    (the same sequence, or the parent it was just forked from)."""

    seq: Sequence
    source: Sequence


@dataclass
class StepResult:
    samples: list[tuple[Sequence, SampleResult]]
    # sequence -> [(logprob, rank, prompt token, top-N)] for the prompt tokens this step scored
    prompt_logprobs: dict[Sequence, list[tuple[float, int, int, list[tuple[int, float]]]]]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(model_config)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model = load_model(model_config, max_model_len, self.dtype, self.device)
        self.num_blocks, self.num_cpu_blocks = self._pool_sizes()
        self.kv_cache = KVCache(model_config, self.num_blocks, self.num_cpu_blocks, self.block_size, self.dtype, self.device)
        for index, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(*self.kv_cache.layer(index))
        self.windows = sorted(set(model_config.sliding_windows), key=lambda w: (w is not None, w or 0))
        self.sampler = Sampler(config.seed, self.device)
        self.kernel_decode = self._choose_decode_backend()

    def _choose_decode_backend(self) -> bool:
        """The C decode kernel for fp32 on CPU when it builds (auto), else SDPA."""
        backend = self.config.attention_backend
        k_cache, _ = self.kv_cache.layer(0)
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
        per_block = bytes_per_block(self.model_config, self.block_size, self.dtype)
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_memory is not None:
            num_blocks = cfg.kv_cache_memory // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory} bytes is less than one KV block ({per_block} bytes)")
        else:
            # A safe share of free memory, but no more than the most the scheduler could use.
            budget = int(available_memory_bytes() * cfg.kv_cache_memory_fraction) // per_block
            num_blocks = max(1, min(budget, self._most_useful_blocks()))
        num_cpu_blocks = 0
        if cfg.preemption_mode == "swap":
            num_cpu_blocks = min(cfg.swap_space // per_block, self._most_useful_blocks())
        return num_blocks, num_cpu_blocks

    def _most_useful_blocks(self) -> int:
        """More blocks than max_num_seqs full-length sequences need could never be used."""
        return self.config.max_num_seqs * -(-self.max_model_len // self.block_size)

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[int, list[int]], sample_requests: list[SampleRequest]) -> StepResult:
        self.kv_cache.swap_out(sched.blocks_to_swap_out)
        self.kv_cache.swap_in(sched.blocks_to_swap_in)
        self.kv_cache.copy(sched.blocks_to_copy)
        result = StepResult([], {})
        if not sched.scheduled:
            return result
        # Decodes first, longest context first (for bucketing), then prefill chunks.
        ordered = sorted(sched.scheduled, key=lambda s: (s.num_new_tokens > 1, -s.seq.num_computed_tokens))
        input_ids, positions, meta, last_rows = self._prepare(ordered, block_tables)
        hidden = self.model(input_ids, positions, meta)
        if sample_requests:
            rows = torch.tensor([last_rows[r.source.seq_id] for r in sample_requests], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            seqs = [r.seq for r in sample_requests]
            result.samples = list(zip(seqs, self.sampler(logits, seqs)))
        self._prompt_logprobs(ordered, hidden, last_rows, result)
        return result

    def _prepare(self, ordered: list[ScheduledSequence], block_tables: dict[int, list[int]]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_rows: dict[int, int] = {}
        decodes: list[tuple[int, list[int]]] = []  # (context length, block table)
        prefills: list[PrefillChunk] = []
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = block_tables[seq.seq_id]
            q_start = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_rows[seq.seq_id] = len(ids) - 1
            if item.num_new_tokens == 1:
                decodes.append((end, table))
            else:
                prefills.append(self._prefill_chunk(q_start, start, end, table))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decodes=self._decode_buckets(decodes),
            prefills=prefills,
            kernel_decode=self.kernel_decode,
        )
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), meta, last_rows

    def _decode_buckets(self, decodes: list[tuple[int, list[int]]]) -> list[DecodeBucket]:
        """Cut decodes (sorted longest first) where padding to the bucket's longest context
        would multiply its KV by more than the backend's factor, into at most its number of calls."""
        max_buckets, factor = KERNEL_DECODE_BUCKETS if self.kernel_decode else SDPA_DECODE_BUCKETS
        buckets: list[DecodeBucket] = []
        start = 0
        while start < len(decodes):
            longest = -(-decodes[start][0] // self.block_size)
            end = start + 1
            last_bucket = len(buckets) == max_buckets - 1
            while end < len(decodes) and (last_bucket or factor * -(-decodes[end][0] // self.block_size) > longest):
                end += 1
            buckets.append(self._decode_bucket(start, decodes[start:end]))
            start = end
        return buckets

    def _decode_bucket(self, start: int, decodes: list[tuple[int, list[int]]]) -> DecodeBucket:
        bs = self.block_size
        max_blocks = max(-(-ctx // bs) for ctx, _ in decodes)
        padded = [table[: -(-ctx // bs)] + [0] * (max_blocks - -(-ctx // bs)) for ctx, table in decodes]
        ctx_lens = torch.tensor([ctx for ctx, _ in decodes], device=self.device)
        masks = {}
        if not self.kernel_decode:
            k_pos = torch.arange(max_blocks * bs, device=self.device)
            for window in self.windows:
                allowed = allowed_keys(ctx_lens - 1, k_pos, window)
                masks[window] = additive_mask(allowed, self.dtype).to(self.device)[:, None, None, :]
        tables = torch.tensor(padded, dtype=torch.long, device=self.device)
        return DecodeBucket(start, len(decodes), tables, ctx_lens, masks)

    def _prefill_chunk(self, q_start: int, start: int, end: int, table: list[int]) -> PrefillChunk:
        chunk = PrefillChunk(q_start=q_start, q_len=end - start, ctx_len=end)
        if start > 0:
            chunk.block_ids = torch.tensor(table[: -(-end // self.block_size)], dtype=torch.long, device=self.device)
        for window in self.windows:
            if start > 0 or window is not None:
                allowed = allowed_keys(torch.arange(start, end), torch.arange(end), window)
                chunk.masks[window] = additive_mask(allowed, self.dtype).to(self.device)
        return chunk

    def _prompt_logprobs(self, ordered: list[ScheduledSequence], hidden: torch.Tensor, last_rows: dict[int, int], result: StepResult) -> None:
        """Logprob of each prompt token given the ones before it (position p predicts p + 1).

        Positions already reported (before a preemption or a fork) are not computed again."""
        for item in ordered:
            seq = item.seq
            num = seq.request.params.prompt_logprobs
            if num is None:
                continue
            first_row = last_rows[seq.seq_id] - (item.num_new_tokens - 1)
            start = max(seq.num_computed_tokens, len(seq.request.prompt_logprobs) - 1)
            end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if start >= end:
                continue
            row = first_row + start - seq.num_computed_tokens
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[row : row + end - start]), dim=-1)
            entries = []
            for offset, position in enumerate(range(start, end)):
                target = seq.token_ids[position + 1]
                rank, top = top_logprobs(logprobs[offset], target, num)
                entries.append((float(logprobs[offset, target]), rank, target, top))
            result.prompt_logprobs[seq] = entries
