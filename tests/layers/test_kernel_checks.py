"""Every C kernel checks the sizes and indices it is given against the capacities its caller
passed, and refuses (KernelRefused, the reason named) before it reads or writes anything:
block ids past the pool, contexts past a block table, slots, positions, tokens and logit rows
past their tables, outputs too small, weights packed for another panel width, block-quantized
(Q8_0/Q4) panels measured by their blocks' real bytes."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pagedllm import LLM
from pagedllm.layers import kernels
from pagedllm.layers.kernels import KernelRefused
from pagedllm.layers.paged_decode import run_kernel, run_prefill_kernel
from pagedllm.layers.quantization import quantize_blocks
from pagedllm.layers.small_matmul import WEIGHT_Q4, WEIGHT_Q8_0, matmul, pack, pack_blocks, pack_swiglu
from pagedllm.models.fused_decode import FusedDecoder, RowDraws, StepStruct
from pagedllm.spec_decode.fused_cycles import SpeculationStruct

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")

NUM_BLOCKS, BLOCK, HKV, GROUP, DIM = 6, 4, 2, 2, 16


def pool() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(NUM_BLOCKS, BLOCK, HKV, DIM, generator=gen) for _ in range(2))


@pytest.mark.parametrize("table, length, reason", [
    ([0, NUM_BLOCKS], 8, "block 1 of its table is 6, the pool has 6"),
    ([0, -1], 8, "block 1 of its table is -1"),
    ([0, 1], 9, "9 positions need 3 blocks, its table has 2"),
    ([0, 1], 0, "context length 0"),
])
def test_paged_decode_refuses_what_lies_outside_the_pool(table, length, reason):
    k, v = pool()
    q = torch.randn(1, HKV, GROUP, DIM)
    out = torch.full_like(q, 7.0)
    with pytest.raises(KernelRefused, match=reason):
        run_kernel(q, k, v, torch.tensor([table]), torch.tensor([length]), 0, 0.25, out=out)
    assert torch.all(out == 7.0)  # nothing written


def test_prefill_attention_refuses_a_context_past_its_table():
    k, v = pool()
    q = torch.randn(3, HKV, GROUP, DIM)
    out = torch.full_like(q, 7.0)
    with pytest.raises(KernelRefused, match="9 positions need 3 blocks"):
        run_prefill_kernel(q, k, v, torch.tensor([0, 1]), 9, 0, 0.25, out)
    with pytest.raises(KernelRefused, match="3 query rows in a context of 2"):
        run_prefill_kernel(q, k, v, torch.tensor([0, 1]), 2, 0, 0.25, out)
    with pytest.raises(KernelRefused, match="is 6, the pool has 6"):
        run_prefill_kernel(q, k, v, torch.tensor([0, NUM_BLOCKS]), 8, 0, 0.25, out)
    assert torch.all(out == 7.0)


def test_small_matmul_refuses_a_weight_packed_for_another_width():
    library = kernels.load()
    narrow = pack(torch.randn(24, 32), library.panel_width() // 2)
    with pytest.raises(KernelRefused, match="were allocated"):
        matmul(library, torch.randn(2, 32), narrow)


# GGUF's bytes per block of 32 as the panels keep them: Q8_0 d (fp16) + 32 int8; Q4 (Q4_1, and Q4_0
# with its minimum) d and m (fp16) + 16 bytes of nibbles.
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 20}


def small_matmul_status(library, struct, x: torch.Tensor, y: torch.Tensor, swiglu: bool = False) -> int:
    return library.small_matmul(ctypes.byref(struct), x.data_ptr(), x.shape[0], x.shape[1], x.numel(), y.data_ptr(),
                                y.shape[1], y.numel(), int(swiglu), 1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_0"])
def test_small_matmul_measures_block_panels_by_their_real_bytes(kind):
    """A block-quantized weight's panels are num_panels x k/32 blocks of 34 (Q8_0) or 20 (Q4)
    bytes a lane, scales inside: exactly that many pass, one byte fewer is refused by name."""
    library = kernels.load()
    width, k = library.panel_width(), 96
    packed = pack_blocks(quantize_blocks(torch.randn(2 * width + 3, k), kind), width)
    struct = packed.struct()
    assert struct.dtype == (WEIGHT_Q8_0 if kind == "Q8_0" else WEIGHT_Q4) and struct.scale is None
    need = packed.num_panels * (k // 32) * BLOCK_BYTES[kind] * width
    assert struct.panel_capacity == need
    x, y = torch.randn(3, k), torch.full((3, packed.n), 7.0)
    assert small_matmul_status(library, struct, x, y) == kernels.KERNEL_OK
    struct.panel_capacity = need - 1
    y.fill_(7.0)
    assert small_matmul_status(library, struct, x, y) == kernels.KERNEL_REFUSED
    assert f"need {need} bytes, {need - 1} were allocated".encode() in library.kernel_last_error()
    assert torch.all(y == 7.0)  # nothing written


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_small_matmul_refuses_block_panels_described_wrongly(kind):
    """Block panels read as another panel width, with k not a whole number of blocks, with more
    inputs than were packed, or a bias shorter than the lanes: refused with the reason."""
    library = kernels.load()
    width = library.panel_width()
    blocks = quantize_blocks(torch.randn(24, 64), kind)
    narrow = pack_blocks(blocks, width // 2)  # half-width panels: the kernel would read twice their bytes
    with pytest.raises(KernelRefused, match="were allocated"):
        matmul(library, torch.randn(2, 64), narrow)
    packed = pack_blocks(blocks, width, torch.randn(24))
    x, y = torch.randn(2, 64), torch.empty(2, 24)
    struct = packed.struct()
    struct.k = 48
    assert small_matmul_status(library, struct, x, y) == kernels.KERNEL_REFUSED
    assert b"48 inputs, not a multiple of 32" in library.kernel_last_error()
    struct = packed.struct()
    struct.k = 128  # twice the blocks that were packed
    assert small_matmul_status(library, struct, torch.randn(2, 128), y) == kernels.KERNEL_REFUSED
    assert b"were allocated" in library.kernel_last_error()
    struct = packed.struct()
    struct.lane_capacity -= 1
    assert small_matmul_status(library, struct, x, y) == kernels.KERNEL_REFUSED
    assert b"scales/biases" in library.kernel_last_error()
    struct = packed.struct()
    assert small_matmul_status(library, struct, x, torch.empty(1, 24)) == kernels.KERNEL_REFUSED  # 2 rows into 1
    swiglu = pack_swiglu(quantize_blocks(torch.randn(2 * width, 64), kind), width)
    struct = swiglu.struct()
    struct.num_panels -= 1  # an odd count of gate/up panels
    assert small_matmul_status(library, struct, x, torch.empty(2, width), swiglu=True) == kernels.KERNEL_REFUSED


def test_small_matmul_refuses_an_unknown_weight_kind():
    library = kernels.load()
    struct = pack(torch.randn(8, 32), library.panel_width()).struct()
    struct.dtype = 4
    assert small_matmul_status(library, struct, torch.randn(1, 32), torch.empty(1, 8)) == kernels.KERNEL_REFUSED
    assert b"unknown weight dtype 4" in library.kernel_last_error()


def test_greedy_rows_refuses_more_rows_than_its_buffers():
    library = kernels.load()
    logits, tokens, logprobs = torch.randn(2, 10), torch.zeros(4, dtype=torch.int64), torch.zeros(4)
    status = library.greedy_rows(logits.data_ptr(), 3, 10, logits.numel(), tokens.data_ptr(), logprobs.data_ptr(), 4, 2)
    assert status == kernels.KERNEL_REFUSED and b"3 rows of 10 logits" in library.kernel_last_error()
    assert torch.all(tokens == 0)


@pytest.fixture(scope="module")
def decoder(model_dir):
    llm = LLM(str(model_dir("llama")), decode_backend="fused", num_kv_blocks=8, block_size=4)
    model = llm.llm_engine.runner.model
    return FusedDecoder(model, kernels.load()), model


def step_arrays(rows: int = 2, **changes) -> dict[str, torch.Tensor]:
    """A valid step of `rows` decode rows at positions 4, 5, ... over blocks 0, 1, 2, changed."""
    pos = torch.arange(4, 4 + rows, dtype=torch.int64)
    arrays = dict(ids=torch.full((rows,), 5, dtype=torch.int64), pos=pos, slots=pos.clone(), lens=pos + 1,
                  tables=torch.tensor([[0, 1, 2]] * rows, dtype=torch.int64), which=torch.arange(rows, dtype=torch.int64))
    for name, (index, value) in changes.items():
        arrays[name].view(-1)[index] = value
    return arrays


def run_step(decoder, arrays: dict[str, torch.Tensor], logit_floats: int | None = None) -> int:
    fused, _ = decoder
    a = arrays
    logits = torch.empty(a["which"].numel(), fused.vocab_size)
    st = StepStruct(a["ids"].numel(), a["ids"].data_ptr(), a["pos"].data_ptr(), a["slots"].data_ptr(), a["lens"].data_ptr(),
                    a["tables"].data_ptr(), a["tables"].shape[1], a["which"].data_ptr(), a["which"].numel(), logits.data_ptr(),
                    logits.numel() if logit_floats is None else logit_floats)
    return fused.library.decode_step(ctypes.byref(fused._struct), ctypes.byref(st), 1)


@pytest.mark.parametrize("changes, reason", [
    (dict(which=(1, 2)), "logit row 1 is row 2 of a 2-row step"),
    (dict(ids=(0, 10**6)), "row 0 has token 1000000, the embedding has"),
    (dict(ids=(1, -1)), "row 1 has token -1"),
    (dict(slots=(0, 8 * 4)), "row 0 writes slot 32 of 32"),
    (dict(tables=(1, 8)), "block 1 of its table is 8, the pool has 8"),
    (dict(lens=(1, 13)), "13 positions need 4 blocks, its table has 3"),
    (dict(pos=(0, 10**7)), "position 10000000"),
    (dict(lens=(0, 0)), "context length 0"),
])
def test_the_fused_step_refuses_indices_outside_its_tables(decoder, changes, reason):
    _, model = decoder
    assert run_step(decoder, step_arrays()) == kernels.KERNEL_OK
    caches = [layer.k_cache.clone() for layer in model.attention_layers()]
    assert run_step(decoder, step_arrays(**changes)) == kernels.KERNEL_REFUSED
    assert reason in decoder[0].library.kernel_last_error().decode()
    assert all(torch.equal(c, layer.k_cache) for c, layer in zip(caches, model.attention_layers()))  # no KV written


@pytest.mark.parametrize("code", [3, -1])
def test_the_fused_step_refuses_an_unknown_pool_element_type(decoder, code):
    fused, _ = decoder
    kept = fused._struct.kv_dtype
    fused._struct.kv_dtype = code
    try:
        assert run_step(decoder, step_arrays()) == kernels.KERNEL_REFUSED
        assert f"kv_dtype is {code}, not 0 (float32), 1 (bfloat16) or 2 (float16)".encode() in fused.library.kernel_last_error()
    finally:
        fused._struct.kv_dtype = kept
    assert run_step(decoder, step_arrays()) == kernels.KERNEL_OK


def test_the_fused_step_refuses_logits_that_do_not_fit(decoder):
    fused, _ = decoder
    assert run_step(decoder, step_arrays(), logit_floats=2 * fused.vocab_size - 1) == kernels.KERNEL_REFUSED
    assert b"2 logit rows" in fused.library.kernel_last_error()


def test_multi_step_calls_refuse_steps_past_the_table_or_rows_sampled_twice(decoder):
    fused, _ = decoder
    a = step_arrays()
    tokens, logprobs = torch.empty(16, dtype=torch.int64), torch.empty(16)

    def steps(num_steps: int, which: torch.Tensor, capacity: int = 16, draws: RowDraws | None = None, short: int = 0) -> int:
        logits = torch.empty(2, fused.vocab_size)
        st = StepStruct(2, a["ids"].data_ptr(), a["pos"].data_ptr(), a["slots"].data_ptr(), a["lens"].data_ptr(),
                        a["tables"].data_ptr(), 3, which.data_ptr(), 2, logits.data_ptr(), logits.numel())
        threads, seconds = (ctypes.c_int * num_steps)(*[1] * num_steps), (ctypes.c_double * num_steps)()
        drawn = None if draws is None else draws.struct(2, num_steps)
        if drawn is not None:
            drawn.uniform_capacity -= short
        return fused.library.decode_steps(ctypes.byref(fused._struct), ctypes.byref(st), num_steps, threads, seconds,
                                          None if drawn is None else ctypes.byref(drawn), tokens.data_ptr(), logprobs.data_ptr(),
                                          capacity)

    def draws(inverse=(1.0, 0.0), min_p=(0.0, 0.0), u=0.5, num_steps: int = 2, temperature=(1.0, 1.0), top_k=None,
              top_p=None) -> RowDraws:
        uniform = np.full((num_steps, 2), u)
        f32 = lambda values: None if values is None else np.array(values, dtype=np.float32)  # noqa: E731
        return RowDraws(f32(inverse), f32(temperature), f32(min_p), uniform,
                        None if top_k is None else np.array(top_k, dtype=np.int64), f32(top_p))

    assert steps(2, a["which"], draws=draws()) == kernels.KERNEL_OK  # row 0 draws, row 1 takes its argmax
    assert steps(2, a["which"], draws=draws(top_k=(5, 0), top_p=(0.9, 0.0))) == kernels.KERNEL_OK  # filtered; row 1 greedy
    for bad, said in ((dict(inverse=(-1.0, 0.0)), b"row 0 at 1 / temperature -1"), (dict(inverse=(1.0, np.inf)), b"row 1 at 1 / temperature inf"),
                      (dict(min_p=(2.0, 0.0)), b"row 0 with min_p 2"), (dict(u=1.0), b"row 0's uniform number 1 at step 0, outside"),
                      (dict(top_k=(0, 5)), b"row 0 with top_k 0, top_p 1"), (dict(top_p=(0.0, 1.0)), b"row 0 with top_k"),
                      (dict(top_p=(np.nan, 1.0)), b"top_p nan"), (dict(top_p=(1.5, 1.0)), b"top_p 1.5"),
                      (dict(top_k=(5, 5), temperature=(0.0, 1.0)), b"row 0 filtered (top_k 5, top_p 1) at temperature 0"),
                      (dict(top_p=(0.5, 1.0), temperature=(np.inf, 1.0)), b"at temperature inf")):
        assert steps(2, a["which"], draws=draws(**bad)) == kernels.KERNEL_REFUSED, bad
        assert said in fused.library.kernel_last_error(), fused.library.kernel_last_error()
    assert steps(2, a["which"], draws=draws(inverse=(0.0, 0.0), u=1.0)) == kernels.KERNEL_OK  # greedy rows' numbers unread
    assert steps(2, a["which"], draws=draws(), short=1) == kernels.KERNEL_REFUSED
    assert b"2 steps of 2 rows draw from 3 numbers" in fused.library.kernel_last_error()

    assert steps(6, a["which"]) == kernels.KERNEL_OK  # positions 4..10 and 5..11 fit 3 blocks of 4
    assert steps(8, a["which"]) == kernels.KERNEL_REFUSED  # row 1 would reach position 12
    assert b"need 4 blocks" in fused.library.kernel_last_error()
    assert steps(2, torch.tensor([0, 0])) == kernels.KERNEL_REFUSED
    assert b"samples twice" in fused.library.kernel_last_error()
    assert steps(6, a["which"], capacity=11) == kernels.KERNEL_REFUSED


def test_speculation_refuses_a_budget_past_its_output_rows(decoder):
    fused, _ = decoder
    i64 = lambda *values: (ctypes.c_int64 * len(values))(*values)  # noqa: E731

    def speculate(budget: int, capacity: int = 12, newest: int = 4) -> int:
        """One cycle (k = 2) of one sequence whose newest token is at `newest`, over blocks
        0, 1, 2, into output rows of 4 tokens."""
        arrays = [i64(0, 1, 2), i64(capacity), i64(budget), i64(5), i64(newest), i64(newest), i64(*[0] * 4),
                  (ctypes.c_float * 4)(), i64(0), i64(0), i64(0)]
        table, cap, bud, history, position, draft_position, tokens, logprobs, num_tokens, proposed, accepted = (
            ctypes.addressof(a) for a in arrays)
        spec = SpeculationStruct(1, 2, table, 3, cap, bud, history, 1, position, draft_position, None, tokens, logprobs, 4,
                                 num_tokens, proposed, accepted, float("-inf"))
        threads, seconds = (ctypes.c_int * 2)(1, 1), (ctypes.c_double * 2)()
        return fused.library.speculate_greedy(ctypes.byref(fused._struct), ctypes.byref(fused._struct), ctypes.byref(spec), 1,
                                              threads, seconds)

    assert speculate(budget=4) == kernels.KERNEL_OK
    assert speculate(budget=5) == kernels.KERNEL_REFUSED
    assert b"budget 5, rows of 4" in fused.library.kernel_last_error()
    assert speculate(budget=4, capacity=16) == kernels.KERNEL_OK  # the budget, not the capacity, bounds its reach
    assert speculate(budget=4, capacity=16, newest=10) == kernels.KERNEL_REFUSED  # 10 + 4 positions need a 4th block
    assert b"14 positions need 4 blocks" in fused.library.kernel_last_error()


@pytest.fixture(scope="module")
def q4_decoder(model_dir):
    """The fused step over kept blocks: Q4_1 projections, a Q8_0 LM head (qwen2: biases too)."""
    llm = LLM(str(model_dir("qwen2")), decode_backend="fused", num_kv_blocks=8, block_size=4, quantization="q4")
    model = llm.llm_engine.runner.model
    return FusedDecoder(model, kernels.load()), model


def test_the_fused_step_checks_block_quantized_matrices_by_their_bytes(q4_decoder):
    fused, model = q4_decoder
    layer = fused._layers[0]
    assert layer.qkv.dtype == WEIGHT_Q4 and fused._lm_head.dtype == WEIGHT_Q8_0
    assert run_step(q4_decoder, step_arrays()) == kernels.KERNEL_OK
    for name in ("qkv", "o", "gate_up", "down"):
        matrix = getattr(fused._layers[1], name)
        caches = [a.k_cache.clone() for a in model.attention_layers()]
        matrix.panel_capacity -= 1
        try:
            assert run_step(q4_decoder, step_arrays()) == kernels.KERNEL_REFUSED
        finally:
            matrix.panel_capacity += 1
        message = fused.library.kernel_last_error().decode()
        assert "decode step: layer 1" in message and "were allocated" in message, message
        assert all(torch.equal(c, a.k_cache) for c, a in zip(caches, model.attention_layers()))  # nothing written
    fused._lm_head.k -= 16  # not a whole number of blocks
    try:
        assert run_step(q4_decoder, step_arrays()) == kernels.KERNEL_REFUSED
    finally:
        fused._lm_head.k += 16
    assert b"LM head: a block-quantized matrix" in fused.library.kernel_last_error()
    assert run_step(q4_decoder, step_arrays()) == kernels.KERNEL_OK


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_small_matmul_refuses_int8_activations_it_cannot_honour(kind):
    """int8 activations (Matrix.int8_activations) only for block-quantized panels, and only 0 or 1;
    with the flag the kernel still refuses sizes that do not fit."""
    library = kernels.load()
    width = library.panel_width()
    struct = pack(torch.randn(8, 32), width).struct()
    struct.int8_activations = 1
    assert small_matmul_status(library, struct, torch.randn(1, 32), torch.empty(1, 8)) == kernels.KERNEL_REFUSED
    assert b"int8_activations 1 on a matrix of dtype 0" in library.kernel_last_error()
    packed = pack_blocks(quantize_blocks(torch.randn(24, 64), kind), width)
    struct = packed.struct()
    struct.int8_activations = 2
    assert small_matmul_status(library, struct, torch.randn(2, 64), torch.empty(2, 24)) == kernels.KERNEL_REFUSED
    assert b"int8_activations 2" in library.kernel_last_error()
    struct.int8_activations = 1
    assert small_matmul_status(library, struct, torch.randn(2, 64), torch.empty(2, 24)) == kernels.KERNEL_OK
    assert small_matmul_status(library, struct, torch.randn(2, 64), torch.empty(1, 24)) == kernels.KERNEL_REFUSED
    struct.k = 48
    assert small_matmul_status(library, struct, torch.randn(2, 48), torch.empty(2, 24)) == kernels.KERNEL_REFUSED
    assert b"48 inputs, not a multiple of 32" in library.kernel_last_error()
    struct.k = 64
    struct.panel_capacity -= 1
    assert small_matmul_status(library, struct, torch.randn(2, 64), torch.empty(2, 24)) == kernels.KERNEL_REFUSED
    assert b"were allocated" in library.kernel_last_error()


def test_the_fused_step_checks_int8_activation_matrices_too(q4_decoder):
    fused, _ = q4_decoder
    matrices = [fused._lm_head, *(getattr(layer, name) for layer in fused._layers for name in ("qkv", "o", "gate_up", "down"))]
    for matrix in matrices:
        matrix.int8_activations = 1
    try:
        assert run_step(q4_decoder, step_arrays()) == kernels.KERNEL_OK
        fused._layers[1].down.int8_activations = 3
        assert run_step(q4_decoder, step_arrays()) == kernels.KERNEL_REFUSED
        assert b"int8_activations 3" in fused.library.kernel_last_error()
    finally:
        for matrix in matrices:
            matrix.int8_activations = 0


def test_the_fused_step_refuses_lora_indices_and_ranks_it_cannot_take(decoder):
    """Step.lora (csrc/decode_step.c): a row naming an adapter past the step's, a pair of rank
    above the stack buffer, or a gate/up pair without the raw gate/up panels is refused by name."""
    from pagedllm.layers.kernel_interface import STRUCTS

    fused, model = decoder
    num_layers = len(model.model.layers)
    a, b_t = torch.zeros(4, 64), torch.zeros(4, 64)  # layer 0's q_proj: 64 -> 64
    rows = torch.tensor([0, -1], dtype=torch.int64)
    pairs = (STRUCTS["LoraPair"] * (num_layers * 7))()
    lora = STRUCTS["Lora"](num_adapters=1, row_adapter=rows.data_ptr(), pairs=pairs, gate_up_raw=None)

    def run(**change) -> int:
        a = step_arrays()
        logits = torch.empty(2, fused.vocab_size)
        st = StepStruct(rows=2, token_ids=a["ids"].data_ptr(), positions=a["pos"].data_ptr(), slots=a["slots"].data_ptr(),
                        ctx_lens=a["lens"].data_ptr(), block_tables=a["tables"].data_ptr(), max_blocks=3,
                        logit_rows=a["which"].data_ptr(), num_logits=2, logits=logits.data_ptr(), logits_capacity=logits.numel(),
                        lora=ctypes.pointer(lora))
        return fused.library.decode_step(ctypes.byref(fused._struct), ctypes.byref(st), 1)

    pair = lambda rank=4, b=b_t.numel(): STRUCTS["LoraPair"](a=a.data_ptr(), b_t=b_t.data_ptr(), rank=rank,  # noqa: E731
                                                            a_capacity=a.numel(), b_capacity=b)
    pairs[0] = pair()  # layer 0's q_proj
    assert run() == kernels.KERNEL_OK
    pairs[0] = pair(b=b_t.numel() - 1)
    assert run() == kernels.KERNEL_REFUSED and b"needs [r, 64] and [r, 64] elements" in fused.library.kernel_last_error()
    pairs[0] = pair()
    rows[0] = 1
    assert run() == kernels.KERNEL_REFUSED and b"row 0 uses LoRA adapter 1 of 1" in fused.library.kernel_last_error()
    rows[0] = 0
    pairs[0] = pair(rank=300)
    assert run() == kernels.KERNEL_REFUSED and b"has rank 300" in fused.library.kernel_last_error()
    pairs[0], pairs[4] = STRUCTS["LoraPair"](), pair(b=4 * 128)  # gate_proj (refused before anything is read)
    assert run() == kernels.KERNEL_REFUSED and b"without the raw gate/up panels" in fused.library.kernel_last_error()


def test_the_prefill_lora_delta_refuses_what_lies_outside_its_buffers():
    """lora_delta (a prefill's site deltas, csrc/decode_step.c): a pair smaller than its rank and
    shape say, a row naming an adapter past the struct's, inputs or outputs shorter than the rows
    and columns asked — each refused by name before anything is read; the delta itself is added
    to the adapter rows only, equal to PyTorch's (x a^T) b_t."""
    from pagedllm.layers.kernel_interface import STRUCTS

    library = kernels.load()
    gen = torch.Generator().manual_seed(0)
    a, b_t = torch.randn(4, 64, generator=gen), torch.randn(4, 32, generator=gen)  # one layer's o_proj: 64 -> 32
    x, y = torch.randn(3, 64, generator=gen), torch.randn(3, 32, generator=gen)
    rows = torch.tensor([0, -1, 0], dtype=torch.int64)
    pairs = (STRUCTS["LoraPair"] * 7)()
    pairs[3] = STRUCTS["LoraPair"](a=a.data_ptr(), b_t=b_t.data_ptr(), rank=4, a_capacity=a.numel(), b_capacity=b_t.numel())
    lora = STRUCTS["Lora"](num_adapters=1, row_adapter=rows.data_ptr(), pairs=pairs, gate_up_raw=None)
    shapes = torch.tensor([[64, 32, 0]], dtype=torch.int64)

    def run(m=3, x_capacity=x.numel(), y_capacity=y.numel()) -> int:
        return library.lora_delta(ctypes.byref(lora), 1, 0, 3, 1, shapes.data_ptr(), x.data_ptr(), m, 64, x_capacity,
                                  y.data_ptr(), 32, y_capacity, 2)

    expected = y.clone()
    expected[[0, 2]] += (x[[0, 2]] @ a.t()) @ b_t
    assert run() == kernels.KERNEL_OK
    torch.testing.assert_close(y, expected)
    assert run(x_capacity=x.numel() - 1) == kernels.KERNEL_REFUSED and b"in 191 and 96 floats" in library.kernel_last_error()
    assert run(y_capacity=95) == kernels.KERNEL_REFUSED and b"in 192 and 95 floats" in library.kernel_last_error()
    pairs[3].b_capacity = b_t.numel() - 1
    assert run() == kernels.KERNEL_REFUSED and b"needs [r, 64] and [r, 32] elements" in library.kernel_last_error()
    pairs[3].b_capacity = b_t.numel()
    rows[1] = 1
    assert run() == kernels.KERNEL_REFUSED and b"row 1 uses adapter 1 of 1" in library.kernel_last_error()
    torch.testing.assert_close(y, expected)  # nothing written by a refused call
