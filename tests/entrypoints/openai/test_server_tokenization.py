"""/tokenize, /detokenize, /tokenizer_info: the shapes lm-evaluation-harness's remote tokenizer reads."""
from __future__ import annotations

from server_process import MAIN, MAIN_MAX_LEN, assert_error
from transformers import AutoTokenizer


def test_tokenize_detokenize_roundtrip(http, serve_models):
    tokenizer = AutoTokenizer.from_pretrained(serve_models / "tiny-llama")
    text = "def roundtrip(x):\n    return x  # é"
    body = http.post("/tokenize", json={"model": MAIN, "prompt": text}).json()
    assert body == {"tokens": tokenizer.encode(text), "count": len(tokenizer.encode(text)), "max_model_len": MAIN_MAX_LEN}
    assert http.post("/detokenize", json={"model": MAIN, "tokens": body["tokens"]}).json() == {"prompt": text}
    assert http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == body["tokens"]


def test_tokenizer_info(http):
    info = http.get("/tokenizer_info", params={"model": MAIN}).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["pad_token"] == "<pad>"
    assert "messages" in info["chat_template"] and info["model_max_length"] == MAIN_MAX_LEN
    assert info["vocab_size"] == 384
    assert http.get("/tokenizer_info").json()["model"] == MAIN  # one model loaded: "model" may be omitted


def test_tokenization_errors(http):
    assert_error(http.post("/detokenize", json={"model": MAIN, "tokens": [1, 10**9]}), 400, "tokens", "outside the vocabulary")
    assert_error(http.post("/detokenize", json={"model": MAIN, "tokens": [-1]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, "model")
    assert_error(http.post("/tokenize", json={"model": MAIN}), 400, "prompt")
