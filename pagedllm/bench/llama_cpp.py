"""llama.cpp as a baseline for `pagedllm bench decode --against llama.cpp`, through
llama-cpp-python (an optional, bench-only dependency: `pip install llama-cpp-python==0.3.36`,
which compiles llama.cpp for this CPU) on the same GGUF file, with the engine's thread count.

On a CPU with AMX (Sapphire Rapids) in a VM, the default build (GGML_NATIVE) crashed in its
first decode (2026-11-26); built without AMX it runs:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python==0.3.36

Single-stream decode is timed like ours, from the first generated token to the last (greedy,
the prompt evaluated first), and prefill as the time to evaluate a prompt into an empty cache.
A batch of sequences decodes as llama.cpp's own parallel example does: one context holding
`n_seq_max` sequences in a unified KV cache, each step one `llama_decode` of a batch with one
token per sequence, greedy on each row's logits (flash attention off, as `Llama` has it: with it
on, a random prompt's first greedy token already differed from the single-stream loop's). Checked
by hand on 8 random 32-token prompts: 7 of 8 sequences gave the single-stream loop's 10 greedy
tokens; the 8th parted at a near-tie (llama.cpp's batched matmuls round differently).
"""
from __future__ import annotations

import ctypes
import time

import numpy as np


def load(path: str, threads: int, context: int):
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise SystemExit("--against llama.cpp needs llama-cpp-python: pip install llama-cpp-python==0.3.36 "
                         f"(it builds llama.cpp from source; {exc})") from exc
    return Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=512, verbose=False)


def build_features() -> str:
    """The instruction sets this llama.cpp build uses ("AVX2 FMA F16C ..."), from its system info:
    an AVX2-only build (for an AVX2 machine's figures) and the native one print differently."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()  # "CPU : SSE3 = 1 | AVX2 = 1 | ..."
    flags = [part.split("=")[0].split(":")[-1].strip() for part in info.split("|") if part.strip().endswith("= 1")]
    return " ".join(flag for flag in flags if flag.startswith(("AVX", "AMX")))


def decode_rate(llm, prompt: list[int], new_tokens: int, sampling: dict, seed: int) -> float:
    """Tokens/s from the first generated token to the last, each token picked by llama.cpp's
    sampler chain as `sampling` says (generate()'s temp, top_k, top_p, min_p: decode.Sampling),
    seeded."""
    llm.reset()
    llm.set_seed(seed)
    times = []
    for _ in llm.generate(prompt, reset=True, **sampling):
        times.append(time.perf_counter())
        if len(times) == new_tokens:
            break
    return (len(times) - 1) / (times[-1] - times[0])


def prefill_rate(llm, prompt: list[int]) -> float:
    """Prompt tokens/s of one evaluation into an empty KV cache."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


class ParallelDecoder:
    """Greedy decode of several sequences at once in one llama.cpp context (the model of `llm`)."""

    def __init__(self, llm, sequences: int, context: int, threads: int):
        import llama_cpp

        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = context, context, min(context, 512)
        params.n_seq_max, params.kv_unified = sequences, True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama_cpp.Llama, the single-stream baseline
        params.n_threads = params.n_threads_batch = threads
        self.lib, self.sequences = llama_cpp, sequences
        self.ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context for the parallel decode")
        self.vocab = llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(context, 0, sequences)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _greedy(self, row: int) -> int:
        pointer = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (self.vocab,))))

    def rate(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Generated tokens/s of all sequences together, from the step of their first generated
        token to the step of their last (the prompts prefilled first, not timed)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        entries = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        self._decode(entries)
        rows = [i for i, entry in enumerate(entries) if entry[3]]
        tokens = [self._greedy(row) for row in rows]
        positions = [len(p) for p in prompts]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            self._decode([(t, pos, seq, True) for seq, (t, pos) in enumerate(zip(tokens, positions))])
            tokens = [self._greedy(row) for row in range(len(prompts))]
            positions = [pos + 1 for pos in positions]
        return len(prompts) * (new_tokens - 1) / (time.perf_counter() - start)
