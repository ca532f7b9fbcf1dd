"""One model name per file: the default model, `serve --model FILE` and a --model-dir entry name the
same GGUF file alike (issue 44: `SmolLM2-135M-Instruct` against `SmolLM2-135M-Instruct.Q4_1`), and
no name in a --model-dir is ambiguous."""
from __future__ import annotations

from pathlib import Path

from pagedllm.entrypoints.model_names import gguf_name, loadable_models, served_name
from pagedllm.paths import DEFAULT_MODEL_NAME, default_model


def test_the_default_model_file_is_served_under_the_default_name():
    assert served_name(default_model()) == DEFAULT_MODEL_NAME


def test_quantization_tags_are_dropped():
    names = {f: gguf_name(Path(f)) for f in (
        "a.Q4_1.gguf", "b-Q4_K_M.gguf", "c.IQ4_XS.gguf", "d_f16.gguf", "e.BF16.gguf", "plain.gguf", "Q8_0.gguf")}
    assert names == {"a.Q4_1.gguf": "a", "b-Q4_K_M.gguf": "b", "c.IQ4_XS.gguf": "c", "d_f16.gguf": "d",
                     "e.BF16.gguf": "e", "plain.gguf": "plain", "Q8_0.gguf": "Q8_0"}


def test_a_model_dir_names_each_entry_once(tmp_path):
    (tmp_path / "folder-model").mkdir()
    (tmp_path / "folder-model" / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "two.Q4_1.gguf", "two.Q8_0.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"GGUF")
    found = loadable_models(tmp_path)
    assert {k: v.name for k, v in found.items()} == {
        "folder-model": "folder-model", "SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "two.Q4_1": "two.Q4_1.gguf", "two.Q8_0": "two.Q8_0.gguf"}  # two quantizations: each by its whole name
    assert served_name(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
