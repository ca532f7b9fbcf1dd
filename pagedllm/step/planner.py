"""The one owner of how a step runs.

An engine can run a step many ways: one forward pass (through the PyTorch modules, the fused C
decode step, or a replayed CUDA graph, attending with the C kernels, Triton or SDPA), several
greedy steps in one fused call (multi-step scheduling), the verification of speculative tokens,
or whole greedy speculation cycles in one C call. Which of them an engine may use follows from
its configuration, the device and what could be built; which one a step takes follows from the
sequences it holds. Both are decided here and nowhere else:

- at start-up, `StepPlanner.decide` settles how the engine runs (tensor parallelism, layer-wise
  KV offload) and its backends (attention, the fused decode step, the draft model's, CUDA
  graphs, fused speculation cycles), and refuses a configuration that asks for one that cannot
  run, naming why;
- the scheduler asks how far each sequence may advance this step — whether its proposals are
  verified, how many lookahead slots a decode reserves for the draft's proposals, whether the
  step is a burst (several tokens per sequence) and how many tokens each may propose next — and
  puts the answers in the step as per-sequence token budgets (step/scheduler_output.py);
- the model runner asks how to fill those budgets (`step_kind`), whether a short prompt can be
  laid out as decode rows, and whether a forward pass runs as one fused C call (and it captures
  CUDA graphs for decode steps only where the planner says so).

Everything else (the scheduler's queues and blocks, the runner's tensors) stays with its owner.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch

from pagedllm.config import EngineConfig, ModelConfig, SpeculativeConfig
from pagedllm.layers import kernels, triton_attention
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.paged_decode import kernel_supported
from pagedllm.layers.small_matmul import MAX_ROWS
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm.engine")


class StepKind(enum.Enum):
    FORWARD = "forward"  # one forward pass; then speculative proposals, where asked for
    GREEDY_STEPS = "greedy_steps"  # `token_budget` steps in one fused call, each taking its argmax or drawing (a burst)
    SPEC_CYCLES = "spec_cycles"  # greedy draft-model speculation cycles in one C call (spec_decode/fused_cycles.py)


class PlannedSequence(Protocol):
    """What the planner reads of a sequence (the engine's `Sequence`)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    num_computed_tokens: int
    spec_token_ids: list[int]
    grammar: object


@dataclass(frozen=True)
class Burst:
    """A step whose every sequence may take several tokens: `budget` of them (and as many
    positions reserved), or `fallback` when the pool cannot hold those positions."""

    budget: int
    fallback: int
    max_proposals: int  # what each may propose afterwards (a fused cycle proposes afresh)


@dataclass(frozen=True)
class StepPlanner:
    """The decisions (defaults: plain steps, SDPA, nothing fused), and the rules that apply them."""

    max_model_len: int = 1 << 30
    tensor_parallel_size: int = 1  # ranks the model is split across (worker/tensor_parallel.py)
    kv_offload: bool = False  # the pool in host memory, two layers on the device (worker/kv_offload.py)
    attention_backend: str = "sdpa"  # kernel | triton | sdpa
    fused_decode: bool = False  # small all-decode steps as one C call (models/fused_decode.py)
    # Weights packed in panels for the small-M kernel: for the fused step, or as the only copy of a
    # GGUF / q4 model's blocks (then every product reads them, layers/linear.py)
    small_matmul_panels: bool = False
    cuda_graphs: bool = False  # all-decode steps replayed from CUDA graphs (worker/cuda_graphs.py)
    num_scheduler_steps: int = 1  # greedy steps per engine step for a burst of plain greedy decodes
    # A step of plain greedy decodes as a burst of one: the fused call takes each row's argmax
    # while its logits are in cache, and the sampler's staging and packing are skipped (the same
    # tokens and logprobs; not with adapters or speculation, whose steps take the forward path)
    fused_argmax: bool = False
    max_burst_seqs: int = MAX_ROWS  # device bursts (not fused): the most sequences one takes
    speculation: SpeculativeConfig | None = None
    draft_kernel_attention: bool = False  # the draft model attends with the C kernels
    draft_fused_decode: bool = False  # the draft's one-token passes run as fused decode steps
    fused_spec_cycles: bool = False  # greedy speculation cycles in one C call
    # Prompt chunks that fit one fused step run as its decode rows; not with int8 activations,
    # whose prompts take the modules' row-deterministic ops so their bits do not depend on the
    # split (the fused step's own attention and norms differ in the last bits, which int8 magnifies)
    prompt_rows_fused: bool = True
    # Greedy steps of a burst whose requests all return their output whole (FINAL_ONLY): nobody
    # sees their tokens arrive in fours, and the Python around a step is paid once per burst
    final_only_steps: int = 1
    # The next step scheduled while the device runs this one (engine/scheduler.py, async scheduling)
    async_scheduling: bool = False
    # What the operator asked for and does not get, and why (the server prints it at start)
    notices: tuple[str, ...] = ()

    # ---- start-up ----------------------------------------------------------------------------
    @classmethod
    def decide(cls, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> "StepPlanner":
        """The backends this engine uses; ValueError (or RuntimeError for a build that failed)
        when the configuration asks for one that cannot run."""
        device, dtype = config.torch_device(), config.torch_dtype(model_config)
        fused_possible = _fused_decode_possible(config, model_config, dtype, device)
        attention = _attention_backend(config, model_config.head_dim, dtype, device)
        fused = fused_possible and attention == "kernel"
        if config.kv_cache_dtype != "auto" and attention != "kernel":
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs the C attention kernels (CPU, a float32 "
                             f"model); this engine attends with {attention!r}")
        if fused_possible and not fused and config.decode_backend == "fused":
            raise RuntimeError("decode_backend='fused' needs the C decode attention kernel, which is not in use")
        # Multi-step bursts: one fused C call on CPU; otherwise passes back to back on the device,
        # with attention that reads context lengths from tensors (not SDPA's host-built masks)
        device_bursts = (not fused and attention in ("kernel", "triton") and config.tensor_parallel_size == 1
                         and not config.kv_offload and config.speculative_config is None)
        if (config.num_scheduler_steps or 1) > 1 and not (fused or device_bursts):
            logger.warning("num_scheduler_steps=%d needs the fused decode step (CPU) or the C/Triton attention kernels "
                           "on one device without offload or speculation: every engine step runs one step",
                           config.num_scheduler_steps)
        overlap, notices = _async_scheduling(config, fused)
        graphs = (not config.enforce_eager and device.type == "cuda" and attention == "triton"
                  and config.tensor_parallel_size == 1 and not config.kv_offload and model_config.moe is None)
        panels = fused or (fused_possible and config.quantization in ("q4", "gguf"))
        planner = cls(max_model_len, config.tensor_parallel_size, config.kv_offload, attention, fused, panels, graphs,
                      (config.num_scheduler_steps or 1) if fused or device_bursts else 1,
                      fused and not config.enable_lora and config.speculative_config is None,
                      MAX_ROWS if fused else config.max_num_seqs, config.speculative_config, async_scheduling=overlap,
                      notices=notices, prompt_rows_fused=not config.int8_activations,
                      final_only_steps=_final_only_steps(config, fused, device_bursts))
        return planner._with_draft(dtype, device)

    def _with_draft(self, dtype: torch.dtype, device: torch.device) -> "StepPlanner":
        """A draft model attends with the C kernels when the target does and its heads fit them,
        runs its one-token passes fused when it can, and fused cycles need both models fused."""
        spec = self.speculation
        if spec is None or not spec.uses_draft_model:
            return self
        draft = draft_model_config(spec.model, spec.draft_attention_window)
        kernel = self.attention_backend == "kernel" and _kernel_attention_supported(draft.head_dim, dtype, device)
        fused = kernel and not fused_decode_unsupported(draft, dtype, device) and kernels.load() is not None
        return replace(self, draft_kernel_attention=kernel, draft_fused_decode=fused,
                       fused_spec_cycles=spec.fused_cycles and fused and self.fused_decode)

    @property
    def kernel_attention(self) -> bool:
        return self.attention_backend == "kernel"

    @property
    def draft_model(self) -> bool:
        """A draft model keeps its KV in the target's blocks (so a block is complete only once
        both have computed it)."""
        return self.speculation is not None and self.speculation.uses_draft_model

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculation.num_speculative_tokens if self.speculation is not None else 0

    @property
    def max_fused_spec_seqs(self) -> int:
        """The most sequences one fused speculation call takes (its verification is one fused step)."""
        return MAX_ROWS // (self.num_speculative_tokens + 1) if self.fused_spec_cycles else 0

    @property
    def max_burst_rows(self) -> int:
        """The most sequences a greedy burst takes: the fused step's rows, or any step's
        sequences when the passes run back to back on the device."""
        return self.max_burst_seqs if self.max_steps > 1 or self.fused_argmax else 0

    @property
    def max_steps(self) -> int:
        """The most greedy steps a burst takes (streamed or not)."""
        return max(self.num_scheduler_steps, self.final_only_steps)

    # ---- the scheduler's questions -----------------------------------------------------------
    def max_proposals(self, num_running: int) -> int:
        """How many tokens a decode may propose for the next step: speculation pauses while the
        batch is large (disable_by_batch_size)."""
        spec = self.speculation
        if spec is None or (spec.disable_by_batch_size is not None and num_running >= spec.disable_by_batch_size):
            return 0
        return spec.num_speculative_tokens

    def fuses_speculation(self, running: Sequence[PlannedSequence], queued: bool) -> bool:
        """Whether this step's decodes are for fused speculation cycles: nothing waits to be
        admitted or swapped in, speculation is not paused, and every running sequence is a plain
        greedy decode, few enough for one call. Their pending proposals (from an engine-driven
        step) are then dropped: the cycles propose afresh."""
        return (0 < len(running) <= self.max_fused_spec_seqs and not queued and self.max_proposals(len(running)) > 0
                and all(plain_greedy_decode(seq) for seq in running))

    def num_to_verify(self, seq: PlannedSequence, budget: int, fusing: bool) -> int:
        """How many of a decode's proposals its chunk verifies: as many as the token budget
        leaves room for; none for a prompt chunk, a grammar-constrained row, or fused cycles."""
        if fusing or seq.grammar is not None or not seq.spec_token_ids or seq.num_tokens - seq.num_computed_tokens != 1:
            return 0
        return min(len(seq.spec_token_ids), max(budget - 1, 0))

    def lookahead_slots(self, seq: PlannedSequence) -> int:
        """Slots a decode reserves past its chunk for the draft model's proposals."""
        if not self.draft_model or seq.num_tokens - seq.num_computed_tokens != 1:
            return 0
        return self.num_speculative_tokens

    def burst(self, seqs: Sequence[PlannedSequence], fusing: bool) -> Burst | None:
        """For a step of decodes that all sample, with nothing queued: fused speculation cycles
        (num_scheduler_steps of them, each k + 1 positions; the first k + 1 are reserved as the
        decodes' lookahead), or num_scheduler_steps greedy steps when every sequence is a plain
        greedy decode with nothing to verify (one, where the fused call takes the argmax); None:
        a step whose rows the sampler samples."""
        if fusing:
            cycle = self.num_speculative_tokens + 1
            return Burst(self.num_scheduler_steps * cycle, cycle, self.num_speculative_tokens)
        if not seqs or len(seqs) > self.max_burst_rows:
            return None
        if not all(self.plain_burst_decode(seq) and not seq.spec_token_ids for seq in seqs):
            return None
        whole = all(seq.params.output_kind is RequestOutputKind.FINAL_ONLY for seq in seqs)
        steps = min(self.final_only_steps if whole else self.num_scheduler_steps,
                    *(tokens_left(seq, self.max_model_len) for seq in seqs))
        return Burst(steps, 1, 0) if steps > 1 or (steps == 1 and self.fused_argmax) else None

    def plain_burst_decode(self, seq: PlannedSequence) -> bool:
        """A decode a burst may take: a plain greedy one, or where the fused call draws tokens
        itself (the fused step without adapters or speculation) a plain random one."""
        return plain_greedy_decode(seq) or (self.fused_argmax and plain_random_decode(seq))

    def overlappable(self, seq: PlannedSequence) -> bool:
        """Whether a sequence's step may be advanced before its output is back (async
        scheduling): nothing of its next step needs its latest tokens on the host — no grammar
        mask, no proposals, no prompt logprobs. (Penalties read the latest token on the device.)"""
        return seq.grammar is None and not seq.spec_token_ids and seq.params.prompt_logprobs is None

    # ---- the runner's questions --------------------------------------------------------------
    def step_kind(self, budget: int, max_proposals: int, greedy_burst: bool = False) -> StepKind:
        """How to fill a step's token budget (a burst gives every sequence the same one; a greedy
        burst may be of one step)."""
        if budget <= 1 and not greedy_burst:
            return StepKind.FORWARD
        return StepKind.SPEC_CYCLES if max_proposals and self.fused_spec_cycles else StepKind.GREEDY_STEPS

    def decode_rows_fit(self, num_positions: int) -> bool:
        """Whether a step's positions fit one fused step, so its prompt chunks too are laid out as
        decode rows, each attending to the context up to its own position — what their prefill
        computes — and the step is one C call instead of a pass through the modules (with fp32
        activations only: `prompt_rows_fused`)."""
        return self.fused_decode and self.prompt_rows_fused and num_positions <= MAX_ROWS

    def runs_fused(self, decoder, meta: AttentionMetadata, num_rows: int) -> bool:
        """Whether a forward pass runs as one fused decode step (`decoder`, when the model has
        one): all rows decodes attended by the C kernel, few enough."""
        return decoder is not None and decoder.accepts(meta, num_rows)


def plain_greedy_decode(seq: PlannedSequence) -> bool:
    """A greedy decode whose tokens are argmaxes of the raw logits and nothing more: its next
    input is its argmax, whatever the other rows do (multi-step bursts, fused speculation cycles,
    whose C kernels take the argmax themselves: a logit_bias or allowed_token_ids would be lost)."""
    params = seq.params
    return (
        seq.num_tokens - seq.num_computed_tokens == 1
        and params.greedy
        and params.logprobs in (None, 0)  # the chosen token's own logprob (rank 1) is all a step gives
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and seq.num_output_tokens >= params.min_tokens
        and seq.grammar is None
        and not params.restricts_tokens
    )


def plain_random_decode(seq: PlannedSequence) -> bool:
    """A random decode whose token the fused call can draw itself: from the raw logits at its
    temperature, top-k, top-p and min_p (the sampler's kernels, called in the C loop), and
    nothing else a greedy burst would lose (plain_greedy_decode's other conditions)."""
    params = seq.params
    return (
        seq.num_tokens - seq.num_computed_tokens == 1
        and not params.greedy
        and params.logprobs is None  # a drawn token's rank is not the call's to give
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and seq.num_output_tokens >= params.min_tokens
        and seq.grammar is None
        and not params.restricts_tokens
    )


def tokens_left(seq: PlannedSequence, max_model_len: int) -> int:
    """The most tokens the sequence may still generate (max_tokens, then the model's length)."""
    left = max_model_len - seq.num_tokens
    max_tokens = seq.params.max_tokens
    return left if max_tokens is None else min(left, max_tokens - seq.num_output_tokens)


def draft_model_config(path: str, window: int | None) -> ModelConfig:
    """The draft model's config, every layer's window cut to `window` (draft_attention_window)."""
    config = ModelConfig.from_pretrained(path)
    if window is None:
        return config
    return replace(config, sliding_windows=tuple(window if w is None else min(w, window) for w in config.sliding_windows))


def fused_decode_unsupported(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> list[str]:
    """Why the fused decode step cannot run a model of this config on this device (empty: it
    can); what a caller adds of its own (attention backend, parallelism) it checks itself."""
    reasons = []
    if device.type != "cpu" or dtype != torch.float32:
        reasons.append("it runs on CPUs in float32")
    if config.head_dim % 8:
        reasons.append("it attends with the C decode kernel (head_dim a multiple of 8)")
    if config.moe is not None:
        reasons.append("it computes dense MLPs (this is a mixture of experts)")
    return reasons


def _fused_decode_possible(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                           device: torch.device) -> bool:
    """Whether the fused decode step can run (decode_backend auto or fused); with 'fused', a
    reason it cannot is an error."""
    if config.decode_backend == "torch":
        return False
    reasons = fused_decode_unsupported(model_config, dtype, device)
    if config.attention_backend == "sdpa":
        reasons.append("it attends with the C decode kernel (attention_backend auto or kernel)")
    if config.tensor_parallel_size > 1 or config.kv_offload:
        reasons.append("it runs the whole model over KV pools bound once (no tensor parallelism, no KV offload)")
    if not reasons and kernels.load() is None:
        reasons.append("the CPU kernels could not be built (see the log)")
    if reasons and config.decode_backend == "fused":
        raise ValueError("decode_backend='fused' cannot be used: " + "; ".join(reasons))
    return not reasons


def _async_scheduling(config: EngineConfig, fused: bool) -> tuple[bool, tuple[str, ...]]:
    """Async scheduling where it can overlap anything: one process whose forward passes are
    queued on a device (or the CPU's modules path, which runs it in order), without speculation
    or layer-wise offload (they read each step's tokens on the host); the fused C step returns
    only once it has run, so there is nothing to overlap. (Whether it runs, and the notice
    saying why not.)"""
    if not config.async_scheduling:
        return False, ()
    clashes = {"the fused C decode step (decode_backend='torch' turns it off)": fused,
               "tensor_parallel_size > 1": config.tensor_parallel_size > 1, "kv_offload": config.kv_offload,
               "speculative_config": config.speculative_config is not None}
    reasons = [name for name, clash in clashes.items() if clash]
    if not reasons:
        return True, ()
    notice = f"async_scheduling is off: it does not run with {', '.join(reasons)}"
    logger.warning(notice)
    return False, (notice,)


def _attention_backend(config: EngineConfig, head_dim: int, dtype: torch.dtype, device: torch.device) -> str:
    """'kernel': the C attention kernels, for fp32 on CPU when they build; 'triton': the Triton
    kernels, on CUDA; 'sdpa' where neither runs (auto) or when asked for."""
    backend = config.attention_backend
    if backend == "sdpa":
        return "sdpa"
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        reason = triton_attention.unavailable_reason(device)
        if reason is not None and backend == "triton":
            raise ValueError(f"attention_backend='triton' cannot be used: {reason}")
        return "triton" if reason is None else "sdpa"
    supported = _kernel_attention_supported(head_dim, dtype, device)
    if backend == "auto" and not supported:
        return "sdpa"
    if not supported:
        raise ValueError(
            "attention_backend='kernel' needs float32 KV caches on the CPU and a head_dim that is a multiple "
            "of 8; use 'sdpa' or 'auto'"
        )
    if kernels.load() is not None:
        return "kernel"
    if backend == "kernel":
        raise RuntimeError("attention_backend='kernel' was asked for, but the kernel could not be built (see the log)")
    return "sdpa"


# Greedy steps a burst of requests that return their output whole takes by default (the fused
# step only, where it was measured: single stream +19 % on an AVX2 Zen 3, docs/engine.md)
AUTO_FINAL_ONLY_STEPS = 4


def _final_only_steps(config: EngineConfig, fused: bool, device_bursts: bool) -> int:
    """Steps of a burst whose requests all return their output whole: the configured
    num_scheduler_steps, or by default AUTO_FINAL_ONLY_STEPS where the fused step runs without
    adapters or speculation (which take bursts only when asked for)."""
    if not (fused or device_bursts):
        return 1
    if config.num_scheduler_steps is not None:
        return config.num_scheduler_steps
    return AUTO_FINAL_ONLY_STEPS if fused and not config.enable_lora and config.speculative_config is None else 1


def _kernel_attention_supported(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C attention kernels take this model's caches: their own check
    (`kernel_supported`), asked of an empty cache of the same dtype, device and head_dim."""
    return kernel_supported(torch.empty(0, 1, 1, head_dim, dtype=dtype, device=device))
