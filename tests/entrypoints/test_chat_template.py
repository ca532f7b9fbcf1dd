"""Rendering a conversation: template variables reach the template, the renderer's own arguments
cannot be overridden through them, and a template's refusal is a ChatTemplateError."""
from __future__ import annotations

import time

import pytest

from pagedllm.entrypoints.chat_template import ChatTemplateError, render_chat
from tiny_models import build_tokenizer

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if persona %}[as {{ persona }}]{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = TEMPLATE
    return tok


def test_chat_template_kwargs_reach_the_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages, chat_template_kwargs={"persona": "a pirate"}) == "user: hi\n[as a pirate]assistant:"
    assert render_chat(tokenizer, messages, add_generation_prompt=False) == "user: hi\n"


def test_renderer_arguments_cannot_be_overridden(tokenizer):
    with pytest.raises(ChatTemplateError, match="tokenize"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], chat_template_kwargs={"tokenize": True})


def test_no_template_is_a_clear_error(tmp_path):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(build_tokenizer(tmp_path, chat_template=False), [{"role": "user", "content": "hi"}])


def test_a_template_that_never_ends_is_stopped_at_its_deadline(tokenizer, monkeypatch):
    """Two nested 100,000-iteration loops (10^10 iterations) once held a model's requests forever."""
    from pagedllm.entrypoints import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"did not finish within 0.5 s"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], chat_template=endless)
    assert time.monotonic() - start < 2
    time.sleep(0.6)  # past the deadline: nothing is raised later into this thread
    assert render_chat(tokenizer, [{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_a_template_that_multiplies_its_input_is_refused(tokenizer, monkeypatch):
    from pagedllm.entrypoints import chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDERED_CHARS", 1000)
    with pytest.raises(ChatTemplateError, match=r"rendered 2000 characters, more than 1000"):
        render_chat(tokenizer, [{"role": "user", "content": "x" * 1000}],
                    chat_template="{{ messages[0]['content'] * 2 }}")
