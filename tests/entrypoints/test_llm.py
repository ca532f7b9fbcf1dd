"""The offline `LLM` API: vLLM's shapes for prompts, params, outputs, metrics and stats."""
from __future__ import annotations

import pytest

from pagedllm import LLM, CompletionOutput, RequestOutput, SamplingParams


def test_prompt_forms_params_and_output_shape(model_dir, capsys):
    llm = LLM(str(model_dir("llama")))
    tok = llm.get_tokenizer()
    text = "for i in range(10):\n    total += values[i] * weights[i]\n" * 2
    ids = tok.encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}], [greedy, greedy, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert [type(o) for o in outs] == [RequestOutput] * 3
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids and outs[1].prompt is None
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids + outs[0].outputs[0].token_ids[3:]
    first = outs[0].outputs[0]
    assert isinstance(first, CompletionOutput) and first.index == 0 and first.finish_reason == "length"
    assert first.text == tok.decode(first.token_ids)
    assert isinstance(first.cumulative_logprob, float) and first.logprobs is None and outs[0].finished
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert "Processed prompts" in capsys.readouterr().err  # the tqdm progress bar
    single = llm.generate(text, greedy, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == first.token_ids
    stats = llm.get_stats()
    for key in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_free_blocks", "num_total_blocks", "num_running", "num_waiting", "num_swapped"):
        assert key in stats
    assert len(ids) > 17 and stats["prefix_cache_hits"] > 0  # the same prompt, over a block long, again
    assert llm.reset_prefix_cache()  # vLLM's API: the same prompt next time is computed, not a hit
    again = llm.generate(text, greedy, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first.token_ids and llm.get_stats()["prefix_cache_hits"] == stats["prefix_cache_hits"]


def test_chat_renders_the_template_like_the_server(model_dir):
    """LLM.chat (vLLM's offline chat): the template's text, tokenized without special tokens,
    then generated — one conversation or several, tools given to the template."""
    from pagedllm.entrypoints.chat_template import ChatTemplateError, render_chat

    llm = LLM(str(model_dir("llama")))
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [{"role": "user", "content": "def add(a, b):"}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    outputs = llm.chat([first, second], params, use_tqdm=False)
    for conversation, output in zip([first, second], outputs):
        text = render_chat(tok, conversation)
        assert output.prompt == text and output.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        expected = llm.generate({"prompt_token_ids": output.prompt_token_ids}, params, use_tqdm=False)[0]
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    (single,) = llm.chat(first, params, use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
    (with_tools,) = llm.chat(first, params, tools=[tool], use_tqdm=False)
    assert '"ls"' in with_tools.prompt
    with pytest.raises(ChatTemplateError, match="tokenize"):
        llm.chat(first, params, chat_template_kwargs={"tokenize": True})
