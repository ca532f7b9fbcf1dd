"""Speculation on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, int8 activations by
default) with drafts cut from it by spec_decode/layer_draft.py: greedy tokens identical to the
plain engine on chat prompts. The whole-model cut proposes what the target would (fp32 against the
target's Q4 arithmetic, so nearly always), so its proposals are accepted and the accepted path is
exercised, not only rejections; the engine-driven verification (fused_cycles off, n-gram) too."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.chat_prompts import chat_prompts
from pagedllm.paths import DefaultModelMissing, default_model
from pagedllm.spec_decode.layer_draft import RANKING_QUESTIONS, build

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    try:
        return default_model()
    except DefaultModelMissing as exc:
        pytest.fail(str(exc))  # `make test` installs it: a missing model is a broken set-up, not a skip


@pytest.fixture(scope="module")
def drafts(smollm2, tmp_path_factory):
    """Two cuts of the target: its first two layers (proposals seldom right) and all 30 layers."""
    root = tmp_path_factory.mktemp("smollm2-drafts")
    return {name: build(smollm2, root / name, layers, answer_tokens=16, questions=RANKING_QUESTIONS[:2])
            for name, layers in (("two", [0, 1]), ("whole", list(range(30))))}


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(smollm2):
    llm = LLM(str(smollm2), kv_cache_memory=32 << 20)
    assert llm.llm_engine.config.int8_activations  # the GGUF default the speculating engines share
    prompts = chat_prompts(llm.get_tokenizer(), 3)
    return prompts, greedy(llm, prompts)


@pytest.mark.parametrize("draft, config, min_acceptance", [
    ("two", {"draft_vocab_size": 2048, "quantization": "int8"}, 0.0),
    ("whole", {"quantization": "int8"}, 0.6),
    ("whole", {"quantization": "int8", "fused_cycles": False}, 0.6),
])
def test_tokens_identical_to_plain_engine(smollm2, drafts, plain, draft, config, min_acceptance):
    prompts, expected = plain
    llm = LLM(str(smollm2), kv_cache_memory=32 << 20,
              speculative_config={"model": str(drafts[draft]), "num_speculative_tokens": 3, **config})
    assert greedy(llm, prompts) == expected
    acceptance = llm.get_stats()["spec_decode_acceptance_rate"]
    print(f"{draft} {config}: acceptance {acceptance:.1%}")
    assert acceptance >= min_acceptance


def test_ngram_tokens_identical_to_plain_engine(smollm2, plain):
    """The engine-driven verification (k + 1 rows of a decode in one step) keeps the plain decode's
    int8 activations: with them switched off for any step of more than one token per sequence,
    these answers changed after a few tokens (fixed 2026-11-28)."""
    prompts, expected = plain
    llm = LLM(str(smollm2), kv_cache_memory=32 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert greedy(llm, prompts) == expected
    assert llm.get_stats()["spec_decode_acceptance_rate"] > 0
