"""Embeddings (worker/pooler.py, LLM.embed): the last token's hidden state after the final norm,
L2-normalized, equal to transformers' `last_hidden_state` on the same weights — for a
sliding-window Mistral whose prompts are longer than its window and Qwen3's q/k norms (a plain
Llama: the default GGUF model through the server, test_server_gguf.py) — and computed between steps without changing what the running requests generate."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.outputs import EmbeddingRequestOutput

TEXTS = ["for i in range(10):\n    total += values[i] * weights[i]\n" * 3, "import os", "x"]


def transformers_embeddings(folder, token_lists: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in token_lists]


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])  # Llama: the default GGUF through the server (test_server_gguf.py)
def test_embeddings_equal_transformers_last_hidden_state(model_dir, arch):
    llm = LLM(str(model_dir(arch)), max_num_batched_tokens=64)  # TEXTS[0] alone is a pass; the others share one
    outputs = llm.embed(TEXTS)
    tok = llm.get_tokenizer()
    token_lists = [tok.encode(text) for text in TEXTS]
    if arch == "mistral":
        assert len(token_lists[0]) > 48  # past the sliding window: the window's mask is used
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == token_lists
    for output, ref in zip(outputs, transformers_embeddings(model_dir(arch), token_lists)):
        ours = torch.tensor(output.outputs.embedding)
        assert ours.shape == ref.shape
        assert torch.linalg.vector_norm(ours).item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(ours, torch.nn.functional.normalize(ref, dim=-1), atol=1e-5, rtol=1e-4)
    raw = llm.embed(TEXTS[1], normalize=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), transformers_embeddings(model_dir(arch), token_lists[1:2])[0],
                               atol=1e-4, rtol=1e-4)


def test_embedding_between_steps_leaves_running_requests_alone(model_dir):
    """Embeddings computed mid-generation: the generated tokens are those of an undisturbed run,
    and no KV block is taken (the pool's free count is the same before and after)."""
    llm = LLM(str(model_dir("llama")))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(TEXTS[:2], params, use_tqdm=False)
    for index, text in enumerate(TEXTS[:2]):
        engine.add_request(f"r{index}", text, params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            free = engine.block_manager.num_free_blocks
            embedded = engine.embed([TEXTS[0], TEXTS[2]])
            assert engine.block_manager.num_free_blocks == free and len(embedded) == 2
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        steps += 1
    assert [finished["r0"], finished["r1"]] == [o.outputs[0].token_ids for o in expected]


def test_bad_embedding_prompts_are_value_errors_naming_the_prompt(model_dir):
    llm = LLM(str(model_dir("llama")), max_model_len=64)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.embed(["fine", []])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[10**6]])
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.embed([[1] * 65])
    assert len(llm.embed([[1] * 64])[0].outputs.embedding) == llm.llm_engine.model_config.hidden_size
