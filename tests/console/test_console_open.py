"""The console of a server with no API key and no model (`pagedllm serve` for training only): no
key is asked for, and every panel says plainly that nothing is loaded."""
from __future__ import annotations

import pytest

from .server import ConsoleServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ConsoleServer.start(["--no-model", "--train-slots", "1"], tmp_path_factory.mktemp("console-open"))
    yield srv
    srv.stop()


def test_no_key_no_model(page, artifacts):
    p = page.page
    p.wait_for_selector("#models-table tbody tr", state="attached")  # the page has talked to the API
    p.click("#tabs a[data-tab='models']")
    p.wait_for_selector("#models-table td.hint:has-text('No model')")
    assert not p.is_visible("#key-dialog")
    p.click("#tabs a[data-tab='chat']")
    assert p.text_content("#chat-model option") == "(no model loaded)"
    p.fill("#chat-text", "hello")
    p.press("#chat-text", "Enter")
    p.wait_for_selector("#chat-error:not([hidden])")
    assert "No model is loaded" in p.inner_text("#chat-error")
    p.click("#tabs a[data-tab='metrics']")
    p.wait_for_selector("#metrics-totals [data-total='generated tokens']")
    assert p.inner_text("#metrics-totals [data-total='generated tokens'] b") == "0"
    p.click("#tabs a[data-tab='jobs']")
    p.wait_for_selector("#jobs-table td.hint:has-text('No job yet')")
    assert not p.is_visible("#key-dialog")
