"""A draft model: a smaller model of the same vocabulary that proposes the target's next tokens.

Its KV pool mirrors the target's — the same number of blocks, the same block size, addressed by
the same block ids — so the target's block tables serve both, and the block manager's rules
(prefix cache, copy-on-write, swap, preemption) apply to the draft's KV with no second set of
tables. The draft computes KV for every position the target does: prompt chunks as they are
prefilled, and at each decode the tokens the target has just accepted, before proposing.

Proposing k tokens takes k forward passes: the first over each sequence's catch-up tokens (the
last of which yields proposal 1), then one token per pass, the input of each pass being the
previous pass's proposal, on the device. On a CPU in fp32 the one-token passes run as fused
decode steps (models/fused_decode.py), one C call each. All passes' metadata is staged at once, and the
proposals come back to the host in one copy at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import takewhile
from typing import Callable

import torch

from pagedllm.config import ModelConfig, ModelLoadError
from pagedllm.layers import kernels
from pagedllm.layers.sampler import Sampler
from pagedllm.layers.small_matmul import MAX_ROWS
from pagedllm.models.fused_decode import FusedDecoder
from pagedllm.models.loader import load_model
from pagedllm.spec_decode import draft_vocab
from pagedllm.step.planner import StepPlanner, draft_model_config
from pagedllm.worker.input_batch import BatchChunk, attention_metadata, stage_batch
from pagedllm.worker.kv_cache import KVCache, bytes_per_block
from pagedllm.worker.sampling_inputs import SampleRow, SamplingPlan, sampling_metadata, stage_sampling
from pagedllm.worker.staging import Staging


# A prompt chunk of up to this many fused steps' rows is mirrored as fused steps (DraftModel._mirror_in_fused_steps).
MIRROR_STEPS = 8


@dataclass
class DraftRequest:
    seq_id: int
    start: int  # first position whose draft KV is not valid yet
    tokens: list[int]  # tokens at positions start, start + 1, ... (all known now)
    block_table: list[int]
    num_proposals: int  # 0: only compute KV (a prompt chunk)
    row: SampleRow | None = None  # how to sample proposals (penalties left out)


class DraftModel:
    def __init__(self, path: str, target: ModelConfig, max_model_len: int, dtype: torch.dtype, device: torch.device,
                 planner: StepPlanner, vocab_size: int | None = None, quantization: str | None = None, p_min: float = 0.0,
                 window: int | None = None):
        """`planner`: whether its passes run fused (and when); `vocab_size`: score only the
        draft's that many most frequent tokens (draft_vocab.py); `quantization`: its weights
        quantized at load (layers/quantization.py); `p_min`: a greedy proposal the draft gives
        less probability ends the request's proposals (SpeculativeConfig.draft_p_min); `window`:
        every layer attends to at most this many positions (SpeculativeConfig.draft_attention_window)."""
        self.p_min = p_min
        self.planner = planner
        config = draft_model_config(path, window)
        if config.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"the draft model's vocab_size {config.vocab_size} differs from the target's {target.vocab_size}; "
                "a draft model must share the target's tokenizer")
        if config.max_position_embeddings < max_model_len:
            raise ModelLoadError(
                f"the draft model allows {config.max_position_embeddings} positions, fewer than max_model_len={max_model_len}")
        self.model_config = config
        subset = draft_vocab.read(path, config.vocab_size)[:vocab_size] if vocab_size is not None else None
        self.library = kernels.load() if planner.draft_fused_decode else None
        panels = self.library.panel_width() if self.library is not None else None
        self.model = load_model(config, max_model_len, dtype, device, logit_token_ids=subset, panel_width=panels,
                                quantization=quantization)
        # column of the draft's logits -> token id (None: the whole vocabulary, in order)
        self.vocab = torch.tensor(subset, device=device) if subset is not None else None
        self.full_vocab_size = config.vocab_size
        self.dtype, self.device = dtype, device
        self.windows = sorted(set(config.sliding_windows), key=lambda w: (w is not None, w or 0))
        self.kv_cache: KVCache | None = None
        self.kernel_attention = False
        self.probs: dict[int, torch.Tensor] = {}  # seq id -> q rows of its pending proposals (random sampling)

    @property
    def reach(self) -> int | None:
        """How far back from a position its KV depends on the KV of earlier ones (each layer's
        window, summed): a prompt's positions further back than this from its end are never
        read. None: every layer sees the whole context."""
        windows = self.model_config.sliding_windows
        return None if any(w is None for w in windows) else sum(windows)

    def bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.model_config, block_size, self.dtype)

    def allocate(self, num_blocks: int, num_cpu_blocks: int, block_size: int, kernel_attention: bool) -> None:
        """The mirror pool; the C decode kernel when the planner says so (the target uses it and
        this model's heads fit it)."""
        self.kv_cache = KVCache(self.model_config, num_blocks, num_cpu_blocks, block_size, self.dtype, self.device)
        for index, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(*self.kv_cache.layer(index))
        self.kernel_attention = kernel_attention
        if self.library is not None and self.kernel_attention:
            self.model.fused = FusedDecoder(self.model, self.library)  # the one-token passes: one C call each

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], sampler: Sampler, generator_for: Callable[[SampleRow], torch.Generator],
                block_size: int) -> dict[int, list[int]]:
        """Catch up every request's KV and propose its tokens; seq id -> proposals."""
        kernel_attention = self.kernel_attention
        if self.model.fused is not None:
            requests = [r for r in requests if not self._mirror_in_fused_steps(r, block_size)]
        if not requests:
            return {}
        proposing = [i for i, r in enumerate(requests) if r.num_proposals > 0]
        staging = Staging()
        passes = [self._stage_first_pass(requests, proposing, staging, block_size, kernel_attention)]
        for j in range(2, max((requests[i].num_proposals for i in proposing), default=0) + 1):
            passes.append(self._stage_pass(j, requests, proposing, staging, block_size, kernel_attention))
        views = staging.to(self.device)
        latest = torch.zeros(len(proposing), dtype=torch.long, device=self.device)
        proposals = torch.full((len(proposing), max(len(passes), 1)), -1, dtype=torch.long, device=self.device)
        probs: dict[int, list[torch.Tensor]] = {}
        for j, (layout, members, plan) in enumerate(passes, start=1):
            prefix = f"d{j}."
            meta = attention_metadata(layout, views, kernel_attention, block_size, self.windows, self.dtype, prefix)
            ids = views[prefix + "input_ids"] if j == 1 else latest.index_select(0, views[prefix + "feed"])
            fused = self.planner.runs_fused(self.model.fused, meta, ids.shape[0])
            logits = self.model.step_logits(ids, views[prefix + "positions"], meta, views[prefix + "logit_rows"], fused)
            if not members:  # catching up only: the KV it wrote, no logits
                continue
            rows = [requests[proposing[m]].row for m in members]
            tokens, sure = self._sample(logits, plan, views, sampler, lambda r: generator_for(rows[r]), rows, probs)
            member_index = views[prefix + "members"]
            latest = latest.index_copy(0, member_index, tokens)
            made = tokens if sure is None else tokens.masked_fill(~sure, -1)  # -1: unproposed, and so is the rest
            proposals.index_put_((member_index, torch.full_like(member_index, j - 1)), made)
        values = proposals.tolist()  # the proposals' one device->host copy
        for seq_id, rows in probs.items():
            self.probs[seq_id] = torch.stack(rows)
        return {requests[i].seq_id: list(takewhile(lambda t: t >= 0, values[m])) for m, i in enumerate(proposing)}

    def _mirror_in_fused_steps(self, request: DraftRequest, block_size: int) -> bool:
        """A prompt chunk to mirror of at most MIRROR_STEPS fused steps' rows (the end of a cached
        prompt, a short prompt, a windowed draft's reach) runs at once as fused steps of
        consecutive rows, each attending up to its own position; True if it did. Why: the draft is
        small, so a pass through its modules costs mostly their fixed dispatch, several fused
        steps' worth."""
        n = len(request.tokens)
        if request.num_proposals > 0 or n > MIRROR_STEPS * MAX_ROWS:
            return False
        for first in range(0, n, MAX_ROWS):
            piece = request.tokens[first : first + MAX_ROWS]
            staging = Staging()
            chunk = BatchChunk(request.seq_id, request.start + first, piece, request.block_table, num_spec=len(piece) - 1)
            layout = stage_batch([chunk], block_size, True, staging)
            staging.add("logit_rows", [])  # only the KV it writes
            views = staging.to(self.device)
            meta = attention_metadata(layout, views, True, block_size, self.windows, self.dtype)
            fused = self.planner.runs_fused(self.model.fused, meta, len(piece))
            self.model.step_logits(views["input_ids"], views["positions"], meta, views["logit_rows"], fused)
        return True

    def _stage_first_pass(self, requests: list[DraftRequest], proposing: list[int], staging: Staging, block_size: int, kernel_attention: bool):
        chunks = [BatchChunk(r.seq_id, r.start, r.tokens, r.block_table, num_spec=self._catch_up_rows(r)) for r in requests]
        layout = stage_batch(chunks, block_size, kernel_attention, staging, "d1.")
        members = list(range(len(proposing)))
        staging.add("d1.logit_rows", [layout.last_rows[i] for i in proposing])
        staging.add("d1.members", members)
        plan = stage_sampling([requests[i].row for i in proposing], staging, "d1.s.") if proposing else None
        return layout, members, plan

    def _catch_up_rows(self, request: DraftRequest) -> int:
        """A proposing decode's catch-up (the tokens the target just accepted) is laid out as
        decode rows, each attending to the context up to its position, like a verification, so
        the pass can run as a fused decode step; a prompt chunk left here (no fused step, or too
        long to mirror in fused steps) stays a prefill."""
        short = len(request.tokens) <= MAX_ROWS  # at most what one fused step takes
        return len(request.tokens) - 1 if request.num_proposals > 0 and short else 0

    def _stage_pass(self, j: int, requests: list[DraftRequest], proposing: list[int], staging: Staging, block_size: int, kernel_attention: bool):
        """Pass j feeds proposal j-1 of each request proposing >= j tokens, at its position."""
        prefix = f"d{j}."
        members = [m for m, i in enumerate(proposing) if requests[i].num_proposals >= j]
        chunks = []
        for m in members:
            request = requests[proposing[m]]
            position = request.start + len(request.tokens) - 1 + j - 1
            chunks.append(BatchChunk(request.seq_id, position, [0], request.block_table))
        layout = stage_batch(chunks, block_size, kernel_attention, staging, prefix)
        staging.add(prefix + "feed", [members[c] for c in layout.order])  # batch row -> its input's member
        staging.add(prefix + "logit_rows", [layout.last_rows[c] for c in range(len(chunks))])
        staging.add(prefix + "members", members)
        plan = stage_sampling([requests[proposing[m]].row for m in members], staging, prefix + "s.")
        return layout, members, plan

    def _sample(self, logits: torch.Tensor, plan: SamplingPlan, views: dict, sampler: Sampler, generator_for,
                rows: list[SampleRow], probs: dict[int, list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy rows propose the argmax; others sample from q (kept for verification, over the
        whole vocabulary: zero outside a reduced one). With a p-min, also whether each row's
        proposal is made: a greedy one only if the draft gives it at least p_min."""
        meta = sampling_metadata(plan, views, generator_for)
        choice = logits.argmax(dim=-1)
        sure = torch.softmax(logits, dim=-1).amax(dim=-1) >= self.p_min if self.p_min > 0 else None
        if sure is not None and meta.random_rows is not None:
            sure = sure.index_fill(0, meta.random_rows, True)
        if meta.random_rows is not None:
            q = sampler.probs(logits, meta)
            choice = choice.index_copy(0, meta.random_rows, (q / sampler.exponential_noise(q, meta)).argmax(dim=-1))
            if self.vocab is not None:
                q = q.new_zeros(q.shape[0], self.full_vocab_size).index_copy_(1, self.vocab, q)
            for position, row_index in enumerate(plan.random):
                probs.setdefault(rows[row_index].seq_id, []).append(q[position])
        return (self.vocab.index_select(0, choice) if self.vocab is not None else choice), sure

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.probs.pop(seq_id, None)


def proposal_row(row: SampleRow) -> SampleRow:
    """The row's sampling parameters without penalties, bans, logit bias or allowed tokens: the
    draft's q may be any distribution (the target's verification applies them), so it is kept
    simple (temperature, top-k/p, min-p)."""
    params = replace(row.params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0,
                     n=1, best_of=None, stop=None, logit_bias=None, allowed_token_ids=None)
    return replace(row, params=params)
