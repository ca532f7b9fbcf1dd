"""The fused decode step: a whole small decode step of a Llama-family model in one C call
(layers/csrc/decode_step.c), for CPUs.

A decode step of a few sequences should cost the time to read the weights once. Through the
PyTorch modules it costs much more: each of a layer's ~15 ops pays the dispatcher's own cache
misses after a matmul has streamed its weights through the caches, and oneDNN's small-M
matmuls stop short of the memory's speed. This module describes the model to the C kernel once
(pointers to the packed weights of layers/small_matmul.py, the norms, the rotary tables, the KV
pools) and then runs each qualifying step with one call: steps whose rows are all decodes
(plain decodes and speculative verification rows), at most `MAX_ROWS` of them (`TILE_ROWS` where
every matrix multiplies int8 activations), attended with the C decode kernel. Everything else — prefills, mixed steps, larger batches — runs through the
modules, which stay the reference the fused step is tested against (tests/models/test_fused_decode.py).
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.layers import kernels
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.kernel_interface import Draws as DrawsStruct
from pagedllm.layers.kernel_interface import Layer as LayerStruct
from pagedllm.layers.kernel_interface import Model as ModelStruct
from pagedllm.layers.kernel_interface import Step as StepStruct
from pagedllm.layers.paged_decode import POOL_DTYPES
from pagedllm.layers.small_matmul import MAX_ROWS, WEIGHT_Q4, WEIGHT_Q8_0, PackedWeight

# The most rows a fused step takes where every matrix multiplies int8 activations: its matmuls
# are then the same integer kernels the modules' would run at any row count (AMX tiles for 16
# rows or more where the CPU has them, csrc/amx_int8.c; the VNNI or AVX2 loops elsewhere), and
# one call saves the modules' per-op dispatch of every layer (docs/engine.md, "Fused steps of
# many rows"). With fp32 activations MAX_ROWS, the decode sizes the small-M kernels are for.
TILE_ROWS = 256


class ThreadCount:
    """Picks the fused step's thread count, 1 or all of torch's, per batch size, by measured step
    time. Why: a step meets its other thread ~180 times, so whenever another process takes a
    core and preempts either thread, the other waits for it (a scheduler tick, 4 ms): on a
    lightly loaded 2-core VM two threads took 17-40 ms a step where one took 16 ms, while on an
    idle machine two threads read the weights up to twice as fast. The thread count does not
    change a result (every chunk is computed the same way by whichever thread takes it).

    Each candidate is tried `warmup` steps (a new row count starts from the nearest warmed-up
    count's times instead: `_seeded`), then the one with the lower recent median runs and
    the other is re-tried for one step now and then (a probe; in a multi-step call, its first
    step) so a change in the machine's load is noticed. A probe costs a step at the slower
    count, so the interval between probes doubles, from `probe_every` up to `max_probe_every`
    steps, while probes keep losing. A probe that beats the current choice's median says the
    machine has changed: the probed count's older times describe the machine before, so they
    are dropped (it takes over at once, as an untried count until it has `warmup` new times),
    and probes come every `probe_every` steps again."""

    def __init__(self, threads: int, warmup: int = 3, probe_every: int = 32, window: int = 9, max_probe_every: int = 512):
        self.candidates = [1, threads] if threads > 1 else [1]
        self.warmup, self.window = warmup, window
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.times: dict[int, dict[int, list[float]]] = {}  # rows -> threads -> recent step times
        self.next_probe: dict[int, int] = {}  # rows -> steps until the next probe
        self.interval: dict[int, int] = {}  # rows -> the current interval between probes

    def plan(self, rows: int, steps: int = 1) -> list[int]:
        """The thread count of each of the next `steps` steps of this many rows."""
        rows = self._key(rows)
        times = self.times.get(rows)
        if times is None:
            times = self.times[rows] = self._seeded(rows)
        untried = [c for c in self.candidates if len(times[c]) < self.warmup]
        if untried:
            return [untried[0]] * steps
        best = self._best(rows)
        if len(self.candidates) == 1:
            return [best] * steps
        self.next_probe[rows] = self.next_probe.get(rows, self.probe_every) - steps
        if self.next_probe[rows] > 0:
            return [best] * steps
        other = next(c for c in self.candidates if c != best)
        return [other] + [best] * (steps - 1)

    def _seeded(self, rows: Hashable) -> dict[int, list[float]]:
        """A new row count's first times: copies of the nearest warmed-up count's, so it starts
        with that count's choice instead of `warmup` steps at each candidate — a batch draining
        from 16 rows to 1 would otherwise spend 3 steps of every count at the slower one. Its own
        times replace the copies as it runs, and its probes correct a wrong start."""
        warmed = [key for key, times in self.times.items() if isinstance(key, int)
                  and all(len(times[c]) >= self.warmup for c in self.candidates)]
        if not isinstance(rows, int) or not warmed:
            return {c: [] for c in self.candidates}
        nearest = min(warmed, key=lambda key: (abs(key - rows), key))
        return {c: list(recent) for c, recent in self.times[nearest].items()}

    def record(self, rows: int, threads: list[int], seconds: list[float]) -> None:
        """The measured time of each step `plan` gave."""
        rows = self._key(rows)
        times = self.times[rows]
        if self.next_probe.get(rows, 1) <= 0:  # the first step was a probe
            won = seconds[0] < self._median(rows, self._best(rows))
            interval = self.interval.get(rows, self.probe_every)
            self.interval[rows] = self.probe_every if won else min(2 * interval, self.max_probe_every)
            self.next_probe[rows] = self.interval[rows]
            if won:
                times[threads[0]].clear()
        for count, step_seconds in zip(threads, seconds):
            times[count].append(step_seconds)
            del times[count][: -self.window]

    @staticmethod
    def _key(rows: Hashable) -> Hashable:
        """Row counts past MAX_ROWS are timed together in powers of two (17-32, 33-64, ...): a
        batch draining one row at a time would otherwise warm up each count anew. Other keys
        (fused speculation cycles' shapes) as they are."""
        return 1 << (rows - 1).bit_length() if isinstance(rows, int) and rows > MAX_ROWS else rows

    def _median(self, rows: int, threads: int) -> float:
        recent = sorted(self.times[rows][threads])
        return recent[len(recent) // 2]

    def _best(self, rows: int) -> int:
        return min(self.candidates, key=lambda c: self._median(rows, c))


def _packed(linear) -> PackedWeight:
    if linear.small is None:
        raise ValueError("the fused decode step needs every linear packed for small-M matmuls")
    return linear.small


def _set_int8(matrix, on: bool) -> None:
    matrix.int8_activations = int(on and matrix.dtype in (WEIGHT_Q8_0, WEIGHT_Q4))


@dataclass
class RowDraws:
    """How a burst's rows draw their tokens, in logit-row order (the sampler's rule, in the C
    call): each row's 1 / temperature (0: its argmax), temperature (what a filtered row is divided
    by), min_p (0: off), top_k (>= vocab: off), top_p (1: off) and one uniform number in [0, 1) a
    step, [num_steps, rows]; top_k and top_p None where no row filters."""

    inv_temperature: np.ndarray  # float32 [rows]
    temperature: np.ndarray  # float32 [rows]
    min_p: np.ndarray  # float32 [rows]
    uniform: np.ndarray  # float64 [num_steps, rows]
    top_k: np.ndarray | None = None  # int64 [rows]
    top_p: np.ndarray | None = None  # float32 [rows]

    def struct(self, num_rows: int, num_steps: int) -> DrawsStruct:
        """The C description (pointing into these arrays, which must outlive the call)."""
        rows = {"inv_temperature": (self.inv_temperature, np.float32), "temperature": (self.temperature, np.float32),
                "min_p": (self.min_p, np.float32), "top_k": (self.top_k, np.int64), "top_p": (self.top_p, np.float32)}
        for name, (array, dtype) in rows.items():
            if array is not None and (array.shape != (num_rows,) or array.dtype != dtype or not array.flags.c_contiguous):
                raise ValueError(f"draws: {name} {array.dtype} {array.shape}, {dtype.__name__} [{num_rows}] in C order expected")
        if self.uniform.shape != (num_steps, num_rows) or self.uniform.dtype != np.float64 or not self.uniform.flags.c_contiguous:
            raise ValueError(f"draws: uniform {self.uniform.dtype} {self.uniform.shape}, float64 [{num_steps}, {num_rows}] expected")
        pointers = {name: None if array is None else array.ctypes.data for name, (array, _) in rows.items()}
        return DrawsStruct(**pointers, uniform=self.uniform.ctypes.data, uniform_capacity=self.uniform.size)


@dataclass
class GreedyRows:
    """A greedy burst's rows as the step's host arrays (int64, C order): input ids, positions,
    slots, context lengths and block tables [rows, max_blocks] of the decode rows, and the rows
    whose logits are taken."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    ctx_lens: np.ndarray
    block_tables: np.ndarray
    logit_rows: np.ndarray

    def check(self) -> int:
        """The row count, once every array is int64, contiguous and shaped for it."""
        arrays = (self.ids, self.positions, self.slots, self.ctx_lens, self.block_tables, self.logit_rows)
        num_rows = self.ids.shape[0] if self.ids.ndim == 1 else -1
        if any(a.dtype != np.int64 or not a.flags.c_contiguous for a in arrays) or num_rows < 0 \
                or any(a.shape != (num_rows,) for a in (self.positions, self.slots, self.ctx_lens)) \
                or self.block_tables.ndim != 2 or self.block_tables.shape[0] != num_rows or self.logit_rows.ndim != 1:
            raise ValueError(f"a fused greedy step's ids, positions, slots and lengths must be int64 [{num_rows}] and its "
                             f"block tables [{num_rows}, max_blocks]")
        return num_rows


class FusedDecoder:
    """Built once the KV pool is bound to the model's attention layers."""

    def __init__(self, model, library: ctypes.CDLL):
        cfg = model.config
        self.library = library
        self.vocab_size = cfg.vocab_size
        layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.attn.k_cache.dtype not in POOL_DTYPES or attn.attn.k_cache.numel() == 0:
                raise ValueError("the fused decode step needs float32, bfloat16 or float16 KV caches bound to the model")
            layers.append(LayerStruct(
                qkv=_packed(attn.qkv_proj).struct(), o=_packed(attn.o_proj).struct(),
                gate_up=_packed(layer.mlp.gate_up_proj).struct(), down=_packed(layer.mlp.down_proj).struct(),
                input_norm=layer.input_layernorm.weight.data_ptr(), post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                q_norm=attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None,
                k_norm=attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None,
                k_cache=attn.attn.k_cache.data_ptr(), v_cache=attn.attn.v_cache.data_ptr(), window=attn.attn.sliding_window or 0,
            ))
        self._layers = (LayerStruct * len(layers))(*layers)
        self._lm_head = _packed(model.lm_head).struct()
        self.threads = ThreadCount(torch.get_num_threads())
        self._greedy_logits: np.ndarray | None = None  # bursts' logits (decode_steps)
        self.max_rows = self._max_rows()
        rotary = model.model.rotary
        k_cache = model.model.layers[0].self_attn.attn.k_cache
        _check_model(model, k_cache, rotary)
        self._struct = ModelStruct(
            num_layers=cfg.num_layers, hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, block_size=k_cache.shape[1],
            eps=cfg.rms_norm_eps, attn_scale=cfg.head_dim**-0.5, embed_rows=model.model.embed_tokens.weight.shape[0],
            num_blocks=k_cache.shape[0], max_position=rotary.cos.shape[0], embed=model.model.embed_tokens.weight.data_ptr(),
            cos=rotary.cos.data_ptr(), sin=rotary.sin.data_ptr(), final_norm=model.model.norm.weight.data_ptr(),
            lm_head=ctypes.pointer(self._lm_head), layers=self._layers, kv_dtype=POOL_DTYPES[k_cache.dtype][0],
        )

    def set_int8_activations(self, on: bool) -> None:
        """Every block-quantized matrix of the step multiplies int8 activations (on) or fp32 ones."""
        for layer in self._layers:
            for name in ("qkv", "o", "gate_up", "down"):
                _set_int8(getattr(layer, name), on)
        _set_int8(self._lm_head, on)
        self.max_rows = self._max_rows()

    def _max_rows(self) -> int:
        """TILE_ROWS while every matrix multiplies int8 activations, else MAX_ROWS."""
        matrices = [self._lm_head, *(getattr(layer, name) for layer in self._layers for name in ("qkv", "o", "gate_up", "down"))]
        return TILE_ROWS if all(m.int8_activations for m in matrices) else MAX_ROWS

    def accepts(self, meta: AttentionMetadata, num_rows: int) -> bool:
        """A forward pass's attention metadata fits one call (`fits`)."""
        return self.fits(meta.kernel_attention, len(meta.prefills), len(meta.decodes), num_rows)

    def fits(self, kernel_attention: bool, num_prefills: int, num_buckets: int, num_rows: int) -> bool:
        """All rows decodes attended by the C kernel (one bucket), at most max_rows of them: what one
        call runs (a forward pass checks its attention metadata, a greedy burst its staged layout)."""
        return kernel_attention and num_prefills == 0 and num_buckets == 1 and num_rows <= self.max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logit_rows: torch.Tensor, lora=None) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] of the step's rows; the KV of every row is written.
        `lora`: the rows' adapters as lora/fused.py describes them (the Lora struct), if any."""
        step, keep = self._step(input_ids, positions, meta, logit_rows)
        if lora is not None:
            step.lora = ctypes.pointer(lora)
        threads = self.threads.plan(step.rows)
        started = time.perf_counter()
        failed = self.library.decode_step(ctypes.byref(self._struct), ctypes.byref(step), threads[0])
        self.threads.record(step.rows, threads, [time.perf_counter() - started])
        kernels.check_status(failed, self.library, "fused decode step")
        return keep[-1]

    def decode_steps(self, rows: GreedyRows, num_steps: int, draws: RowDraws | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`num_steps` decode steps in one call, each row's token fed back as its next input (a
        burst: multi-step scheduling, or one step whose token the call takes): its argmax, or a
        draw where `draws` gives the row a temperature; tokens and their logprobs, [num_steps,
        rows] in logit-row order. Every row samples, and each row's block table covers its last
        position. The rows come as the step's host arrays, not tensors: after a step has streamed
        the weights through the caches each torch op costs ~15 µs of dispatch, and this path is
        CPU-only and makes a dozen of them a token."""
        num_rows = rows.check()
        logits = self._logits_buffer(rows.logit_rows.shape[0])
        step = StepStruct(rows=num_rows, token_ids=rows.ids.ctypes.data, positions=rows.positions.ctypes.data,
                          slots=rows.slots.ctypes.data, ctx_lens=rows.ctx_lens.ctypes.data,
                          block_tables=rows.block_tables.ctypes.data, max_blocks=rows.block_tables.shape[1],
                          logit_rows=rows.logit_rows.ctypes.data, num_logits=rows.logit_rows.shape[0],
                          logits=logits.ctypes.data, logits_capacity=logits.size)
        tokens = np.empty((num_steps, num_rows), dtype=np.int64)
        logprobs = np.empty((num_steps, num_rows), dtype=np.float32)
        plan = self.threads.plan(num_rows, num_steps)
        threads = (ctypes.c_int * num_steps)(*plan)
        seconds = (ctypes.c_double * num_steps)()
        drawn = None if draws is None else draws.struct(num_rows, num_steps)
        failed = self.library.decode_steps(ctypes.byref(self._struct), ctypes.byref(step), num_steps, threads, seconds,
                                           None if drawn is None else ctypes.byref(drawn), tokens.ctypes.data,
                                           logprobs.ctypes.data, tokens.size)
        self.threads.record(num_rows, plan, list(seconds))
        kernels.check_status(failed, self.library, "fused greedy steps")
        return tokens, logprobs

    def _logits_buffer(self, rows: int) -> np.ndarray:
        """Where a greedy burst's logits go (read only by the call itself): kept between calls."""
        if self._greedy_logits is None or self._greedy_logits.shape[0] < rows:
            self._greedy_logits = np.empty((max(rows, MAX_ROWS), self.vocab_size), dtype=np.float32)
        return self._greedy_logits

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              logit_rows: torch.Tensor) -> tuple[StepStruct, list[torch.Tensor]]:
        """The C description of a step, and the tensors it points into (the logits last)."""
        bucket = meta.decodes[0]
        tensors = [t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
                   for t in (input_ids, positions, meta.slot_mapping, bucket.ctx_lens, bucket.block_tables, logit_rows)]
        ids, pos, slots, lens, tables, rows = tensors
        num_rows = ids.shape[0]
        if any(t.shape != (num_rows,) for t in (pos, slots, lens)) or tables.dim() != 2 or tables.shape[0] != num_rows \
                or rows.dim() != 1:
            raise ValueError(f"a fused step's ids, positions, slots and lengths must be [{num_rows}] and its block tables "
                             f"[{num_rows}, max_blocks]")
        logits = torch.empty(rows.shape[0], self.vocab_size, dtype=torch.float32, device=ids.device)
        step = StepStruct(rows=num_rows, token_ids=ids.data_ptr(), positions=pos.data_ptr(), slots=slots.data_ptr(),
                          ctx_lens=lens.data_ptr(), block_tables=tables.data_ptr(), max_blocks=tables.shape[1],
                          logit_rows=rows.data_ptr(), num_logits=rows.shape[0], logits=logits.data_ptr(),
                          logits_capacity=logits.numel())
        return step, [*tensors, logits]


def _check_model(model, k_cache: torch.Tensor, rotary) -> None:
    """What the C step indexes by the numbers it is given has the shape it is described with: the
    embedding [rows, hidden] (more rows than the LM head's columns for a draft's reduced
    vocabulary), every layer's caches [num_blocks, block_size, Hkv, D] alike and contiguous, the
    rotary tables [max_position, D] (the matrices it checks itself)."""
    cfg = model.config
    embed = model.model.embed_tokens.weight
    shapes_ok = embed.dim() == 2 and embed.shape[1] == cfg.hidden_size and embed.is_contiguous() \
        and rotary.cos.shape == rotary.sin.shape and rotary.cos.shape[1] == cfg.head_dim and rotary.cos.is_contiguous() \
        and tuple(k_cache.shape[2:]) == (cfg.num_kv_heads, cfg.head_dim)
    for layer in model.model.layers:
        caches = (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache)
        shapes_ok = shapes_ok and all(c.shape == k_cache.shape and c.dtype == k_cache.dtype and c.is_contiguous() for c in caches)
    if not shapes_ok:
        raise ValueError("the fused decode step needs the embedding, rotary tables and KV caches in the config's shapes")

