"""`pagedllm bench spec` on the default chat model: its chat prompts and its refusal to guess a draft."""
from __future__ import annotations

import argparse
import importlib.util

from pagedllm.bench import spec
from pagedllm.bench.chat_prompts import QUESTIONS, chat_prompts
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.paths import default_model
from pagedllm.spec_decode.layer_draft import RANKING_QUESTIONS


def test_chat_prompts_are_the_models_template_around_each_question():
    tokenizer = load_tokenizer(str(default_model()))
    prompts = chat_prompts(tokenizer, 3, first=1)
    for prompt, question in zip(prompts, QUESTIONS[1:4]):
        text = tokenizer.decode(prompt)
        assert text.count("<|im_start|>") == 3  # system (the template's default), user, assistant
        assert f"<|im_start|>user\n{question}<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
    assert len({tuple(p) for p in prompts}) == 3


def test_the_draft_vocabulary_is_not_ranked_on_the_benchmarks_questions():
    assert not set(RANKING_QUESTIONS) & set(QUESTIONS)


def test_another_target_without_a_draft_is_refused_before_anything_loads(capsys):
    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    assert spec.run(parser.parse_args(["--model", str(default_model())])) == 2
    out = capsys.readouterr().out
    assert "--draft is required" in out
    # the command it names is a module that exists (it named one that did not)
    module = out.split("`python -m ")[1].split()[0]
    assert module == spec.LAYER_DRAFT_MODULE and importlib.util.find_spec(module) is not None
