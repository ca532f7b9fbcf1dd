"""A file that is not a usable GGUF fails with a precise ModelLoadError, before any weight loads."""
from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.config import ModelConfig, ModelLoadError
from pagedllm.gguf import is_gguf, open_gguf


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file" + bytes(100))
    with pytest.raises(ModelLoadError, match=r"is not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        LLM(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [3, 24, 1000, 0.5, 0.999])
def test_truncated(tiny_gguf, tmp_path, keep):
    data = tiny_gguf("llama", "Q4_1").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ModelLoadError, match="truncated|not a GGUF file"):
        LLM(str(cut), kv_cache_memory=16 << 20)


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ModelLoadError, match=r"architecture 'falcon' is not supported \(supported: \['llama'"):
        ModelConfig.from_pretrained(path)


def test_unsupported_tensor_type(tiny_gguf, tmp_path):
    """IQ4_NL (a type we do not read) is refused by name, for the tensor that has it."""
    import gguf

    source = open_gguf(tiny_gguf("llama", "F32"))
    path = tmp_path / "iq4.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in source.metadata.items():
        if key.startswith(("llama.", "tokenizer.ggml.bos", "tokenizer.ggml.eos")):
            writer.add_key_value(key, value, _type(value))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((256, 256 // 32 * 18), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    _finish(writer)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.attn_q.weight' has type IQ4_NL, which pagedllm cannot read"):
        ModelConfig.from_pretrained(path)


def test_is_gguf_by_suffix_or_magic(tiny_gguf, tmp_path, model_dir):
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(tiny_gguf("llama", "F32").read_bytes())
    assert is_gguf(renamed) and is_gguf(tmp_path / "x.gguf") and not is_gguf(model_dir("llama"))
    assert ModelConfig.from_pretrained(renamed).model_type == "llama"


def _type(value):
    import gguf

    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.UINT32


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("weight_type", ["F32", "Q4_1"])
def test_header_reads_what_the_gguf_package_reads(tiny_gguf, weight_type):
    """gguf/header.py against the llama.cpp project's own reader on the same file: every metadata
    value (type included: a string array stays a list of str, a bool a bool), every tensor's type,
    shape, offset and bytes."""
    from gguf import GGUFReader

    from pagedllm.gguf.header import read_header

    path = tiny_gguf("llama", weight_type)
    ours, reader = read_header(str(path)), GGUFReader(path)
    theirs = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    assert any(isinstance(v, list) and v and isinstance(v[0], str) for v in theirs.values())  # a vocabulary
    assert ours.metadata == theirs and [type(v) for v in ours.metadata.values()] == [type(v) for v in theirs.values()]
    assert ours.data_start == int(reader.data_offset) and list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        mine = ours.tensors[tensor.name]
        assert (mine.tensor_type, mine.shape, mine.data_offset) == (tensor.tensor_type, tuple(map(int, tensor.shape)), tensor.data_offset)
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data)
