"""The step contract ships only what changed (step/scheduler_output.py): over a 2,000-token
decode, the bytes of each decode step — what a tensor-parallel engine pickles to every worker —
stay flat, where sending each sequence's history and block table would grow them by the
context. Under tensor parallelism the workers, which keep their own copy of every sequence,
produce the tokens of one process."""
from __future__ import annotations

import pickle

import pytest

from pagedllm import LLM, SamplingParams
from tiny_models import build_model

NUM_TOKENS = 2000
PROMPT = [5 + (7 * i) % 300 for i in range(40)]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("long-context"), "llama", tokenizer=False, max_position_embeddings=4096)


def decode_with_step_sizes(folder, **engine_args) -> tuple[list[int], list[int]]:
    """(tokens, the pickled bytes of every step) of a greedy 2,000-token decode."""
    llm = LLM(str(folder), block_size=16, num_scheduler_steps=1, **engine_args)  # a step per token
    runner = llm.llm_engine.runner
    sizes: list[int] = []
    execute = runner.execute

    def measured(sched):
        sizes.append(len(pickle.dumps(sched)))  # before the runner's state takes it over
        return execute(sched)

    runner.execute = measured
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    try:
        tokens = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()
    return tokens, sizes


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_decode_steps_bytes_stay_flat_over_2000_tokens(long_model, tensor_parallel_size):
    tokens, sizes = decode_with_step_sizes(long_model, tensor_parallel_size=tensor_parallel_size)
    assert len(tokens) == NUM_TOKENS and len(sizes) == NUM_TOKENS  # the prompt's step, then a step per token
    decodes = sizes[1:]
    first, last = decodes[:100], decodes[-100:]
    # A step's bytes vary only with the width of the integers in it (a token id, the context
    # length, a new block id every 16 tokens), never with the context: 2,000 positions of history
    # and 125 block ids would add kilobytes.
    assert max(decodes) - min(decodes) <= 16, (min(decodes), max(decodes))
    assert abs(sum(last) / 100 - sum(first) / 100) <= 8
    assert sizes[0] > max(decodes) + 4 * len(PROMPT)  # the sequence went whole once, its prompt and table with it
    if tensor_parallel_size > 1:
        assert tokens == decode_with_step_sizes(long_model)[0]
