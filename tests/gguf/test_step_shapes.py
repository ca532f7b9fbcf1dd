"""Every step shape on the real default path: SmolLM2-135M-Instruct's GGUF file, its Q4_1 blocks
read by the C kernels, fused decode steps — the path `pagedllm serve` runs (held to exact tokens
with fp32 activations; the default int8 activations, which are not exact, serve every shape in
the every-path test and in the idle long-prompt test).

A prompt longer than one step's token budget makes steps whose rows are all non-final prompt
chunks: nothing to sample. Such a step once handed 0 rows to the LM head and killed the engine.
The property test draws budgets, prompt lengths from 1 to 4 × max_model_len (at and around the
budget's multiples; the long ones refused) and batches mixing them (decodes beside prompt chunks,
prefix-cache hits ending anywhere), and holds every served request's greedy tokens to the modules
path's (`decode_backend="torch"`, one chunk per prompt, no prefix cache)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import stdlib_text  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 96
BUDGETS = (16, 40)
NEW_TOKENS = 3
LENGTHS = sorted({1, 2, *(m * b + d for b in BUDGETS for m in (1, 2) for d in (-1, 0, 1) if m * b + d < MAX_MODEL_LEN),
                  MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 2 * MAX_MODEL_LEN, 4 * MAX_MODEL_LEN})
OFFSETS = (0, 1000)  # where in the text a prompt starts: prompts at the same offset share prefixes
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def engines(smollm2) -> dict[int, LLM]:
    """The default path at each budget (prefix caching on, as served), exact."""
    return {budget: LLM(str(smollm2), kv_cache_memory=16 << 20, max_model_len=MAX_MODEL_LEN,
                        max_num_batched_tokens=budget, int8_activations=False) for budget in BUDGETS}


@pytest.fixture(scope="module")
def text_ids(engines) -> list[int]:
    return engines[BUDGETS[0]].get_tokenizer().encode(stdlib_text(20_000))


@pytest.fixture(scope="module")
def expected(smollm2, text_ids):
    """expected(offset, length) -> the modules path's greedy tokens for that prompt (cached)."""
    llm = LLM(str(smollm2), kv_cache_memory=16 << 20, max_model_len=MAX_MODEL_LEN, decode_backend="torch",
              enable_prefix_caching=False, int8_activations=False)
    cache: dict[tuple[int, int], list[int]] = {}

    def get(offset: int, length: int) -> list[int]:
        if (offset, length) not in cache:
            prompt = {"prompt_token_ids": text_ids[offset : offset + length]}
            cache[offset, length] = llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        return cache[offset, length]

    return get


def count_sampleless_steps(llm: LLM) -> list[int]:
    """Counts the steps of `llm` that sample no row (a one-element list, updated in place)."""
    runner, count = llm.llm_engine.runner, [0]
    launch = runner.launch

    def counting(sched):
        count[0] += bool(sched.chunks) and not any(chunk.token_budget for chunk in sched.chunks)
        return launch(sched)

    runner.launch = counting
    return count


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_prompt_longer_than_the_budget_on_an_idle_engine(smollm2, engines, expected, text_ids, budget):
    """The defect as found: one prompt, nothing else running, its first chunks sample nothing
    (chunks of up to 16 rows run as one fused C step, longer ones through the modules)."""
    llm = engines[budget]
    count = count_sampleless_steps(llm)
    try:
        out = llm.generate([{"prompt_token_ids": text_ids[7 : 7 + 90]}], PARAMS, use_tqdm=False)[0]
    finally:
        del llm.llm_engine.runner.launch
    assert count[0] == 90 // budget
    assert out.outputs[0].token_ids == expected(7, 90)
    default = LLM(str(smollm2), kv_cache_memory=16 << 20, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget)
    assert default.llm_engine.config.int8_activations  # as served: int8 activations
    out = default.generate([{"prompt_token_ids": text_ids[7 : 7 + 90]}], PARAMS, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"


@settings(max_examples=16, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@example(budget=BUDGETS[1], prompts=[(0, 2 * BUDGETS[1] + 1)])  # alone: its first two chunks sample nothing
@example(budget=BUDGETS[1], prompts=[(0, 5), (1000, MAX_MODEL_LEN - 1), (0, BUDGETS[1] + 1)])  # decodes beside chunks
@given(budget=st.sampled_from(BUDGETS),
       prompts=st.lists(st.tuples(st.sampled_from(OFFSETS), st.sampled_from(LENGTHS)), min_size=1, max_size=3))
def test_every_step_shape_serves_the_modules_paths_tokens(engines, expected, text_ids, budget, prompts):
    llm = engines[budget]
    served = [(o, n) for o, n in prompts if n < MAX_MODEL_LEN]
    for offset, length in prompts:
        if length >= MAX_MODEL_LEN:  # refused, and nothing of it stays behind
            with pytest.raises(ValueError, match="max_model_len"):
                llm.generate([{"prompt_token_ids": text_ids[offset : offset + length]}], PARAMS, use_tqdm=False)
    if served:
        outputs = llm.generate([{"prompt_token_ids": text_ids[o : o + n]} for o, n in served], PARAMS, use_tqdm=False)
        for (offset, length), output in zip(served, outputs):
            tokens = output.outputs[0].token_ids
            assert len(tokens) == min(NEW_TOKENS, MAX_MODEL_LEN - length)
            assert tokens == expected(offset, length), f"prompt of {length} tokens at {offset}, budget {budget}"
    stats = llm.llm_engine.get_stats()
    assert not llm.llm_engine.has_unfinished_requests() and stats["num_running"] == stats["num_waiting"] == 0


# ---- every path, on a tiny Q4_1 GGUF (the same blocks-only linears, a fraction of the time) ------
TINY_LEN, TINY_BUDGET = 80, 24
EXACT_ARGS = dict(int8_activations=False)
PATHS = {
    "fused_c": EXACT_ARGS,
    "modules": dict(decode_backend="torch", **EXACT_ARGS),
    "int8_activations": {},  # the default for block-quantized weights
    "bf16_kv": dict(kv_cache_dtype="bfloat16"),
    "f16_kv": dict(kv_cache_dtype="float16"),
    "triton_interpreter": dict(attention_backend="triton", **EXACT_ARGS),
    "multi_step": dict(num_scheduler_steps=4, **EXACT_ARGS),
    "async": dict(async_scheduling=True, decode_backend="torch", **EXACT_ARGS),
    "ngram_speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
                              **EXACT_ARGS),
}
EXACT = {"fused_c", "modules", "triton_interpreter", "multi_step", "async", "ngram_speculation"}
TINY_PROMPTS = [list(range(3, 3 + n)) for n in (TINY_BUDGET * 3 + 1, 2, TINY_BUDGET + 1, TINY_LEN - 1)]
TINY_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_q4(tiny_gguf):
    return str(tiny_gguf("llama", "Q4_1"))


@pytest.fixture(scope="module")
def tiny_expected(tiny_q4) -> list[list[int]]:
    llm = LLM(tiny_q4, decode_backend="torch", enable_prefix_caching=False, max_model_len=TINY_LEN, **EXACT_ARGS)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], TINY_PARAMS,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("path", list(PATHS))
def test_prompts_longer_than_the_budget_on_every_path(tiny_q4, tiny_expected, path):
    """Alone on an idle engine (steps that sample nothing), then batched with decodes; exact paths
    give the modules path's tokens, the others (int8 activations, a half KV cache) serve every
    token; a prompt past max_model_len is refused."""
    llm = LLM(tiny_q4, max_model_len=TINY_LEN, max_num_batched_tokens=TINY_BUDGET, kv_cache_memory=8 << 20, **PATHS[path])
    alone = llm.generate([{"prompt_token_ids": TINY_PROMPTS[0]}], TINY_PARAMS, use_tqdm=False)[0].outputs[0]
    together = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], TINY_PARAMS, use_tqdm=False)]
    assert [len(c.token_ids) for c in [alone, *together]] == [4, 4, 4, 4, 1]  # the last prompt leaves room for 1
    assert all(c.finish_reason == "length" for c in [alone, *together])
    if path in EXACT:
        assert alone.token_ids == tiny_expected[0] and [c.token_ids for c in together] == tiny_expected
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": list(range(3, 3 + 4 * TINY_LEN))}], TINY_PARAMS, use_tqdm=False)
