"""The fused decode step (one C call per small all-decode step) against the PyTorch modules, the
reference: same greedy tokens and logprobs within 1e-4, for every architecture's switches
(tied embeddings and Llama 3.1 rope scaling, sliding windows, qkv bias, q/k norms), batches
shrinking from 16 rows to 1, speculative verification rows, and the AVX2 build."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers import kernels
from pagedllm.layers.small_matmul import MAX_ROWS
from pagedllm.models import fused_decode
from pagedllm.models.fused_decode import TILE_ROWS, FusedDecoder, ThreadCount

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# 16 prompts of different lengths and output lengths: decode steps of 16 rows down to 1.
PROMPTS = [[3 + (7 * i + j) % 300 for j in range(5 + 3 * i)] for i in range(MAX_ROWS)]
PARAMS = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=3) for i in range(MAX_ROWS)]


@pytest.fixture
def run(monkeypatch):
    """run(folder, **engine_args) -> (outputs, the row count of every fused step); run.last: the engine."""
    calls: list[int] = []
    original = FusedDecoder.__call__

    def counted(self, input_ids, *rest):
        calls.append(input_ids.shape[0])
        return original(self, input_ids, *rest)

    monkeypatch.setattr(FusedDecoder, "__call__", counted)

    def go(folder, prompts=PROMPTS, params=PARAMS, **engine_args):
        calls.clear()
        go.last = LLM(str(folder), **engine_args)
        outputs = go.last.generate(prompts, params, use_tqdm=False)
        return outputs, list(calls)

    go.calls = calls
    return go


def assert_same(fused_outputs, torch_outputs, tolerance: float = 1e-4):
    for a, b in zip(fused_outputs, torch_outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, entry in mine.items():
                if token in theirs:
                    assert abs(entry.logprob - theirs[token].logprob) < tolerance


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_step_matches_the_modules(arch, model_dir, run):
    fused, calls = run(model_dir(arch), decode_backend="fused")
    reference, none = run(model_dir(arch), decode_backend="torch")
    assert not none and set(calls) == set(range(1, MAX_ROWS + 1))  # every batch size from 16 down to 1
    assert_same(fused, reference)


def test_the_avx2_build_matches_the_modules(model_dir, monkeypatch, run):
    avx2 = kernels.load(kernels.ISA_FLAGS["avx2"])
    monkeypatch.setattr(kernels, "load", lambda extra_flags=(): avx2)
    fused, calls = run(model_dir("qwen2"), decode_backend="fused")
    assert calls
    reference, _ = run(model_dir("qwen2"), decode_backend="torch")
    assert_same(fused, reference)


def test_int8_fused_step_matches_the_int8_modules(model_dir, run):
    """Both compute with the same int8 weights (the modules with their dequantized values)."""
    fused, calls = run(model_dir("llama3"), decode_backend="fused", quantization="int8")
    reference, _ = run(model_dir("llama3"), decode_backend="torch", quantization="int8")
    assert calls
    assert_same(fused, reference)


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
@pytest.mark.parametrize("build", [(), kernels.ISA_FLAGS["avx2"]], ids=["native", "avx2"])
def test_half_kv_fused_step_matches_the_half_kv_modules(build, kv, model_dir, monkeypatch, run):
    """A bfloat16 or float16 pool: the fused step writes its K/V rounded as torch's .to(dtype)
    does and reads them widened, as the modules' C kernels do. The two paths' fp32 K/V differ in
    their last bits (summation order), which now and then rounds an element to the next half
    value: logprobs within 1e-3 (measured: 1.04e-4 at most with bfloat16), tokens equal. The
    pool the fused step wrote holds the modules' values to within their rounding (a wrong element
    type would write another type's bits there)."""
    library = kernels.load(build)
    monkeypatch.setattr(kernels, "load", lambda extra_flags=(): library)
    fused, calls = run(model_dir("llama"), decode_backend="fused", kv_cache_dtype=kv)
    fused_pool = run.last.llm_engine.runner.kv_cache.k.float()
    reference, _ = run(model_dir("llama"), decode_backend="torch", kv_cache_dtype=kv)
    modules_pool = run.last.llm_engine.runner.kv_cache.k.float()
    assert calls
    assert_same(fused, reference, tolerance=1e-3)
    written = modules_pool != 0
    assert written.sum() > 1000 and run.last.llm_engine.runner.kv_cache.k.dtype == getattr(torch, kv)
    # a few last-bit steps of the fp32 values (more in the sanitizer build's summation order), not
    # another type's bits (1.0 as bfloat16 read as float16 is 1.875)
    relative = ((fused_pool - modules_pool).abs() / modules_pool.abs().clamp_min(1e-2))[written]
    assert relative.max() < 2**-5


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_q4_fused_step_matches_the_q4_modules(arch, model_dir, run):
    """Kept blocks (Q4_1 projections, a Q8_0 LM head; qwen2's biases) in the fused step against
    the modules computing with their dequantized values: the fused step's block kernels and its
    checks of block-quantized matrices, every batch size from 16 rows down."""
    fused, calls = run(model_dir(arch), decode_backend="fused", quantization="q4", int8_activations=False)
    reference, _ = run(model_dir(arch), decode_backend="torch", quantization="q4", int8_activations=False)
    assert set(calls) == set(range(1, MAX_ROWS + 1))
    assert_same(fused, reference)


MANY_PROMPTS = [[3 + (11 * i + j) % 300 for j in range(4 + i)] for i in range(40)]
MANY_PARAMS = [SamplingParams(temperature=0, max_tokens=3 + i % 7, ignore_eos=True, logprobs=3) for i in range(40)]
TILE_ARGS = {"quantization": "q4", "int8_activations": True, "max_num_seqs": 64}


def test_many_rows_go_through_the_fused_step_with_int8_activations(model_dir, monkeypatch, run):
    """Kept blocks with int8 activations: steps of up to TILE_ROWS rows are fused (40 here,
    shrinking) — their matmuls the integer kernels the modules' run at any row count (AMX tiles for
    16 rows or more where the CPU has them, else the VNNI or AVX2 loops). Against the modules, not
    the same tokens and logprobs within 1e-4: the two paths' activations differ in their last bits
    (summation order), which now and then moves an activation's int8 code by one (a logprob by
    0.018 here, and one near-tie of this random model's to the other token). So: each sequence's
    tokens up to where it parts ways with the modules' (>= 90 % of them; measured 221 of 235 with
    the tiles), and their logprobs within 0.05. Where the tiles run, the build without them (VNNI)
    gives the same bits. With fp32 activations (the exact path) a step takes at most MAX_ROWS."""
    assert TILE_ROWS >= 40
    fused, calls = run(model_dir("llama3"), MANY_PROMPTS, MANY_PARAMS, decode_backend="fused", **TILE_ARGS)
    assert max(calls) == 40 and min(calls) < 16
    reference, _ = run(model_dir("llama3"), MANY_PROMPTS, MANY_PARAMS, decode_backend="torch", **TILE_ARGS)
    agree = total = 0
    for a, b in zip(fused, reference):
        ours, theirs = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(ours))
        agree, total = agree + same, total + len(ours)
        for mine, other in zip(a.outputs[0].logprobs[:same], b.outputs[0].logprobs[:same]):
            assert all(abs(entry.logprob - other[token].logprob) < 0.05 for token, entry in mine.items() if token in other)
    print(f"\n[fused ({kernels.load().int8_dot_product().decode()}) vs modules] {agree} of {total} tokens agree")
    assert agree >= 0.9 * total, f"{agree} of {total} tokens"
    _, exact_calls = run(model_dir("llama3"), MANY_PROMPTS, MANY_PARAMS, decode_backend="fused",
                         **{**TILE_ARGS, "int8_activations": False})
    assert max(exact_calls) == MAX_ROWS
    if kernels.load().int8_dot_product().decode() != "amx":
        return
    vnni = kernels.load(("-mno-amx-tile", "-mno-amx-int8"))
    monkeypatch.setattr(kernels, "load", lambda extra_flags=(): vnni)
    without, vnni_calls = run(model_dir("llama3"), MANY_PROMPTS, MANY_PARAMS, decode_backend="fused", **TILE_ARGS)
    assert vnni_calls == calls
    for a, b in zip(fused, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_speculative_verification_rows_go_through_the_fused_step(model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]] * 2
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(model_dir("llama")), decode_backend="torch").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir("llama")), speculative_config=spec)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_larger_batches_and_prefills_use_the_modules(model_dir):
    llm = LLM(str(model_dir("llama")))
    meta_accepts = llm.llm_engine.runner.model.fused.accepts
    from pagedllm.layers.attention import AttentionMetadata, DecodeBucket, PrefillChunk

    decode = DecodeBucket(0, 1, None, None, {})
    assert meta_accepts(AttentionMetadata(None, [decode], [], True), MAX_ROWS)
    assert not meta_accepts(AttentionMetadata(None, [decode], [], True), MAX_ROWS + 1)
    assert not meta_accepts(AttentionMetadata(None, [decode], [PrefillChunk(1, 4, 4)], True), 5)
    assert not meta_accepts(AttentionMetadata(None, [decode], [], False), 1)


def test_fused_backend_refuses_what_it_cannot_run(model_dir):
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(model_dir("llama")), decode_backend="fused", attention_backend="sdpa")
    with pytest.raises(ValueError, match="float32"):
        LLM(str(model_dir("llama")), decode_backend="fused", dtype="bfloat16")
    assert LLM(str(model_dir("llama")), decode_backend="torch").llm_engine.runner.model.fused is None


def test_the_thread_count_follows_the_measured_step_times():
    from pagedllm.models.fused_decode import ThreadCount

    tuner = ThreadCount(2, warmup=2, probe_every=4, window=3)

    def run(cost: dict[int, float], calls: int, steps: int = 1, rows: int = 1) -> list[int]:
        picked = []
        for _ in range(calls):
            plan = tuner.plan(rows, steps)
            tuner.record(rows, plan, [cost[t] for t in plan])
            picked += plan
        return picked

    # a loaded machine, one thread faster: each tried twice, then one; the probes of two lose, so
    # they come 4, 8, then 16 steps apart
    assert run({1: 0.016, 2: 0.030}, 24) == [1, 1, 2, 2] + [1, 1, 1, 2] + [1] * 7 + [2] + [1] * 8
    # the machine goes quiet: the next probe wins, so two threads take over at once (the probed
    # count's times from the loaded machine are dropped, and it runs until it has 2 new ones),
    # and probes come every 4 steps again; the first probe of one loses
    assert run({1: 0.016, 2: 0.010}, 16) == [1] * 7 + [2] + [2] + [2, 2, 2, 1] + [2] * 3
    # multi-step calls of 8 steps: a probe is the call's first step, and the interval counts steps
    assert run({1: 0.016, 2: 0.010}, 3, steps=8) == [1] + [2] * 7 + [2] * 8 + [1] + [2] * 7
    # loaded again: the choice's own times show it within the call, and the next call switches
    assert run({1: 0.016, 2: 0.030}, 2, steps=8) == [2] * 8 + [1] * 8
    # a new batch size starts from the nearest warmed-up one's times (one thread, just chosen for
    # 1 row), its first probe due at once in a call longer than probe_every: two threads win it
    assert run({1: 0.016, 2: 0.010}, 3, steps=8, rows=2) == [2] + [1] * 7 + [2] * 8 + [1] + [2] * 7
    assert ThreadCount(1).plan(rows=3, steps=2) == [1, 1]


def test_a_new_row_count_starts_from_the_nearest_warmed_up_one():
    """A batch draining from 16 rows to 1 would spend `warmup` steps of every count at each
    candidate (measured: most of an offline run's small steps); a new count starts from the
    nearest warmed-up count's choice instead, and its probes still try the other."""
    tuner = ThreadCount(2, warmup=2, probe_every=4)
    for _ in range(4):  # 5 rows: each count tried twice, two threads faster
        plan = tuner.plan(5)
        tuner.record(5, plan, [0.01 if plan[0] == 2 else 0.02])
    assert tuner.plan(5) == [2]
    assert tuner.plan(4, steps=3) == [2, 2, 2]  # never seen: two threads at once, 5's choice
    tuner.record(4, [2, 2, 2], [0.009] * 3)
    assert tuner.plan(4, steps=2) == [1, 2]  # its first probe is due after probe_every steps
    assert tuner.plan((3, 4)) == [1]  # speculation cycles' keys warm up on their own


def test_row_counts_past_16_share_their_timings():
    """A batch draining from 64 rows would warm each count up anew: 17-32, 33-64, ... are timed
    together; counts up to 16 and speculation cycles' keys (tuples) each on their own."""
    key = ThreadCount._key
    assert [key(r) for r in (1, 16, 17, 32, 33, 40, 64, 65)] == [1, 16, 32, 32, 64, 64, 64, 128]
    assert key((3, 4)) == (3, 4)
    tuner = ThreadCount(2, warmup=1)
    for rows in (40, 33, 64):  # one bucket: each candidate is tried once, then the faster one runs
        plan = tuner.plan(rows)
        tuner.record(rows, plan, [0.01 if plan[0] == 2 else 0.02])
    assert tuner.plan(50) == [2]


# (architecture, table blocks, the first row's position): rows within one 128-position part of
# the context, and (a sliding window of 48 too) rows on both sides of the part boundary at 256
PLACES = [("llama", 8, 8 * 16 - MAX_ROWS - 1), ("llama", 24, 250), ("mistral", 24, 250)]


@pytest.mark.parametrize("arch,blocks,start", PLACES, ids=["one-part", "two-parts", "two-parts-window"])
@pytest.mark.parametrize("build", [(), kernels.ISA_FLAGS["avx2"]], ids=["native", "avx2"])
def test_a_verification_row_gets_the_bits_of_a_1_row_step(model_dir, monkeypatch, build, arch, blocks, start):
    """Greedy speculative decoding is token-identical to plain decoding only because a
    verification row's logits are a 1-row step's, bit for bit: a step of 1-16 rows at
    positions p, p+1, ... against 1-row steps at each position (the matmuls take other paths
    for different row counts, small_matmul.c; a context attended in parts is merged in the same
    order whatever part the step's other rows reach)."""
    import ctypes

    import torch

    from pagedllm.models.fused_decode import StepStruct

    library = kernels.load(build)
    monkeypatch.setattr(kernels, "load", lambda extra_flags=(): library)  # the weights packed for its panel width
    llm = LLM(str(model_dir(arch)), decode_backend="fused")
    model = llm.llm_engine.runner.model
    decoder = FusedDecoder(model, library)
    layers = model.attention_layers()
    assert layers[0].k_cache.shape[1] == 16 and start + MAX_ROWS <= blocks * 16
    block_size = 16
    gen = torch.Generator().manual_seed(5)
    for layer in layers:
        for cache in (layer.k_cache, layer.v_cache):
            cache[:blocks].copy_(torch.randn(cache[:blocks].shape, generator=gen))
    table = torch.arange(blocks, dtype=torch.int64)
    tokens = torch.randint(3, decoder.vocab_size, (MAX_ROWS,), generator=gen)

    def step(first: int, rows: int) -> torch.Tensor:
        pos = torch.arange(start + first, start + first + rows, dtype=torch.int64)
        ids, slots, lens = tokens[first : first + rows].clone(), table[pos // block_size] * block_size + pos % block_size, pos + 1
        tables, which = table.repeat(rows, 1).contiguous(), torch.arange(rows, dtype=torch.int64)
        logits = torch.empty(rows, decoder.vocab_size)
        st = StepStruct(rows, ids.data_ptr(), pos.data_ptr(), slots.data_ptr(), lens.data_ptr(), tables.data_ptr(), len(table),
                        which.data_ptr(), rows, logits.data_ptr(), logits.numel())
        assert library.decode_step(ctypes.byref(decoder._struct), ctypes.byref(st), 2) == 0
        return logits

    alone = torch.cat([step(i, 1) for i in range(MAX_ROWS)])
    for rows in range(2, MAX_ROWS + 1):
        assert torch.equal(step(0, rows), alone[:rows]), f"rows={rows}"


# prompts whose decodes cross the 128-, 256- and 384-position boundaries of the attention's parts
LONG_PROMPTS = [[3 + (13 * i + j) % 300 for j in range(length)] for i, length in enumerate((40, 120, 250, 300, 370))]
# (the longest prompt decodes its last 8 tokens alone: a single sequence's parts, every KV head an item)
LONG_PARAMS = [SamplingParams(temperature=0, max_tokens=8 + 8 * i, ignore_eos=True, logprobs=3) for i in range(len(LONG_PROMPTS))]


@pytest.mark.parametrize("arch,build", [("llama", ()), ("mistral", ()), ("qwen3", ()), ("llama", kernels.ISA_FLAGS["avx2"])],
                         ids=["llama", "mistral-window", "qwen3-norms", "llama-avx2"])
def test_contexts_attended_in_parts_match_the_modules(arch, build, model_dir, monkeypatch, run):
    """Contexts longer than a part (128 positions) are attended in parts by both threads and
    merged: tokens and logprobs as the modules' whole-context attention gives them, for contexts
    in one to four parts, a sliding window crossing a part boundary, and q/k norms (which the
    attention items apply to their own copy of the queries)."""
    library = kernels.load(build)
    monkeypatch.setattr(kernels, "load", lambda extra_flags=(): library)
    fused, calls = run(model_dir(arch), prompts=LONG_PROMPTS, params=LONG_PARAMS, decode_backend="fused")
    reference, none = run(model_dir(arch), prompts=LONG_PROMPTS, params=LONG_PARAMS, decode_backend="torch")
    assert calls and not none
    assert_same(fused, reference)


def test_a_short_prompt_chunk_runs_as_one_fused_step(model_dir, run):
    """A step whose positions fit one fused step runs as one even with a prompt chunk in it: a
    short prompt (its prompt logprobs too), and a prompt's remainder after a prefix-cache hit
    (two of the 40-token prompt's three blocks cached), laid out as decode rows. Tokens,
    logprobs and prompt logprobs as the modules compute them."""
    short, cached = [3 + j for j in range(12)], [50 + j for j in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    runs = {}
    for backend in ("fused", "torch"):
        llm = LLM(str(model_dir("llama")), decode_backend=backend, block_size=16)
        first = llm.generate([short, cached], params, use_tqdm=False)  # 52 positions: the modules
        run.calls.clear()
        again = [llm.generate([prompt], p, use_tqdm=False)[0] for prompt, p in ((short, scored), (cached, params))]
        runs[backend] = (first + again, list(run.calls))
    (fused, calls), (reference, none) = runs["fused"], runs["torch"]
    assert not none and calls[0] == 12 and 40 - 32 in calls, calls  # the short prompt; the cached prompt's last 8
    assert_same(fused, reference)
    mine, theirs = fused[2].prompt_logprobs, reference[2].prompt_logprobs
    assert len(mine) == len(short) and mine[0] is None
    for a, b in zip(mine[1:], theirs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


ONE_TOKEN_SAMPLES = """
import json, sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], decode_backend=sys.argv[2])
outs = [llm.generate(["a"], SamplingParams(n=n, max_tokens=4, seed=7), use_tqdm=False)[0] for n in (8, 12, 16)]
print(json.dumps([[c.token_ids for c in out.outputs] for out in outs]))
"""


def test_many_samples_of_a_one_token_prompt_on_the_default_model():
    """Issue 28: n = 8 of the one-token prompt "a" aborted the interpreter (glibc `free(): invalid
    next size`) and n = 12 hung. The prompt is laid out as one fused row, and each of the n
    samples takes that row's logits: 8 logit rows in a 1-row step, whose final norms were
    written into per-thread scratch sized for the rows (decode_step.c), over the heap. Run in a
    child with a deadline, as the crash and the hang were; the tokens are the torch path's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[2] / "models" / "pagedllm-py-tiny")
    runs = {}
    for backend in ("fused", "torch"):
        done = subprocess.run([sys.executable, "-c", ONE_TOKEN_SAMPLES, folder, backend], capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[backend] = json.loads(done.stdout.strip().splitlines()[-1])
    assert [len(samples) for samples in runs["fused"]] == [8, 12, 16]
    assert all(len(tokens) == 4 for samples in runs["fused"] for tokens in samples)
    assert runs["fused"] == runs["torch"]


@pytest.mark.parametrize("prompt_len", [1, 2, 15, 16])
def test_more_logit_rows_than_rows_in_a_fused_step(model_dir, run, prompt_len):
    """n and best_of up to 16 samples of prompts that fit one fused step (their logits taken
    from the prompt's last row 16 times), greedy and sampled, as the modules compute them."""
    prompt = [3 + j for j in range(prompt_len)]
    params = [SamplingParams(n=16, max_tokens=3, seed=1, ignore_eos=True, logprobs=2),
              SamplingParams(n=2, best_of=16, max_tokens=3, seed=2, ignore_eos=True),
              SamplingParams(n=16, temperature=0, max_tokens=3, ignore_eos=True)]
    outputs, calls = {}, {}
    for backend in ("fused", "torch"):
        llm = LLM(str(model_dir("llama")), decode_backend=backend)
        run.calls.clear()
        outputs[backend] = [llm.generate([prompt], p, use_tqdm=False)[0] for p in params]
        calls[backend] = list(run.calls)
    assert prompt_len in calls["fused"] and not calls["torch"]  # the prompt ran as one fused step
    for mine, theirs in zip(outputs["fused"], outputs["torch"]):
        assert [c.token_ids for c in mine.outputs] == [c.token_ids for c in theirs.outputs]


def test_row_draws_point_the_call_at_their_arrays_and_refuse_the_wrong_ones():
    """RowDraws' C description points at its own arrays (NULL for the filters no row uses), and an
    array of the wrong dtype, shape or order is refused by name before the C call reads it."""
    import numpy as np

    from pagedllm.models.fused_decode import RowDraws

    f32 = lambda *v: np.array(v, dtype=np.float32)  # noqa: E731
    draws = RowDraws(f32(1.25, 0.0), f32(0.8, 1.0), f32(0.05, 0.0), np.zeros((3, 2)))
    struct = draws.struct(2, 3)
    assert struct.inv_temperature == draws.inv_temperature.ctypes.data and struct.temperature == draws.temperature.ctypes.data
    assert struct.min_p == draws.min_p.ctypes.data and struct.uniform == draws.uniform.ctypes.data and struct.uniform_capacity == 6
    assert struct.top_k is None and struct.top_p is None
    draws.top_k, draws.top_p = np.array([40, 2**62], dtype=np.int64), f32(0.9, 1.0)
    struct = draws.struct(2, 3)
    assert struct.top_k == draws.top_k.ctypes.data and struct.top_p == draws.top_p.ctypes.data
    for field, bad in (("top_k", np.array([40, 1], dtype=np.int32)), ("top_p", f32(0.9)), ("temperature", np.array([0.8, 1.0])),
                       ("min_p", f32(0.0, 0.1, 0.2)[::2])):
        wrong = RowDraws(**{**draws.__dict__, field: bad})
        with pytest.raises(ValueError, match=f"draws: {field} "):
            wrong.struct(2, 3)
    with pytest.raises(ValueError, match=r"draws: uniform float64 \(3, 2\), float64 \[2, 2\] expected"):
        draws.struct(2, 2)
