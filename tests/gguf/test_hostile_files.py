"""A GGUF whose header lies is refused before anything is allocated for it (issue 39).

Each file here is a valid tiny model with one header field rewritten in place. Before these
checks, `block_count = 2^31` drove a server to 20 GB, `block_count = 100000` grew ~18 MB/s without
an error, a context length or FFN size at the 32-bit maximum or `head_count = 0` were 500s, a tensor
offset of 2^64 - 1 wrapped around and the file loaded, and an EOS id outside the vocabulary loaded
and failed requests later. Each load must fail fast with a `ModelLoadError` naming the field, and
must not grow the process."""
from __future__ import annotations

import resource
import shutil
import time

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.config import ModelConfig, ModelLoadError


def rewritten(source, tmp_path, name: str, key: str, value: int):
    """A copy of `source` with the scalar metadata field `key` set to `value` (same type, in place)."""
    from gguf import GGUFReader

    path = tmp_path / f"{name}.gguf"
    shutil.copy(source, path)
    reader = GGUFReader(path, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
    del reader
    return path


def with_tensor_offset(source, tmp_path, tensor: str, offset: int):
    from gguf import GGUFReader

    path = tmp_path / "offset.gguf"
    shutil.copy(source, path)
    reader = GGUFReader(path, "r+")
    (info,) = [t for t in reader.tensors if t.name == tensor]
    info.field.parts[-1][0] = np.uint64(offset)
    reader.data.flush()
    del reader
    return path


HOSTILE_FIELDS = [
    ("llama.block_count", 2**31, r"block_count=2147483648, but the file holds 2 blocks"),
    ("llama.block_count", 100_000, r"block_count=100000, but the file holds 2 blocks"),
    ("llama.context_length", 2**32 - 1, r"max_position_embeddings=4294967295 is outside \[1, 16777216\]"),
    ("llama.feed_forward_length", 2**32 - 1, r"feed_forward_length=4294967295 .*blk.0.ffn_up.weight"),
    ("llama.embedding_length", 2**32 - 1, r"embedding_length=4294967295 .*token_embd.weight"),
    ("llama.attention.head_count", 0, r"head_count=0"),
    ("tokenizer.ggml.eos_token_id", 1_000_000, r"eos_token_id 1000000 is outside the vocabulary"),
]


@pytest.mark.parametrize("key, value, message", HOSTILE_FIELDS, ids=[f"{k}={v}" for k, v, _ in HOSTILE_FIELDS])
def test_a_lying_header_is_refused_before_allocation(tiny_gguf, tmp_path, key, value, message):
    path = rewritten(tiny_gguf("llama", "Q4_1"), tmp_path, "hostile", key, value)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path), kv_cache_memory=16 << 20)
    assert time.monotonic() - start < 10
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 200, f"refusing the file grew the process by {grown_mb:.0f} MB"


@pytest.mark.filterwarnings("ignore:overflow encountered in scalar add")  # the reader's own sum, which wraps
def test_a_wrapping_tensor_offset_is_refused(tiny_gguf, tmp_path):
    path = with_tensor_offset(tiny_gguf("llama", "Q4_1"), tmp_path, "blk.1.ffn_down.weight", 2**64 - 1)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.ffn_down.weight' .*offset 18446744073709551615"):
        ModelConfig.from_pretrained(path)


def test_a_model_larger_than_memory_is_refused_with_its_size(tmp_path, model_dir):
    """A config whose weights could not fit this machine is refused before a byte is allocated,
    with both numbers in the message (here a folder whose config claims 1,000 layers of 16k width)."""
    folder = tmp_path / "huge"
    shutil.copytree(model_dir("llama"), folder)
    config = (folder / "config.json").read_text()
    import json

    raw = json.loads(config)
    raw.update(num_hidden_layers=1000, hidden_size=16384, intermediate_size=65536, num_attention_heads=128,
               num_key_value_heads=128, head_dim=128)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"needs about [\d.]+ GB for its weights.*[\d.]+ GB is available"):
        LLM(str(folder), kv_cache_memory=16 << 20)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_a_load_that_fails_after_allocating_frees_what_it_took(tmp_path, model_dir):
    """A folder whose config is ~540 MB of weights but whose file holds the tiny model's: the
    weights are allocated, then the first tensor of the wrong shape fails the load. Three such
    loads leave the process where it was."""
    import gc
    import json

    folder = tmp_path / "mismatched"
    shutil.copytree(model_dir("llama"), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(num_hidden_layers=2, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
               num_key_value_heads=16, head_dim=128)
    (folder / "config.json").write_text(json.dumps(raw))
    gc.collect()
    before = _rss_mb()
    for _ in range(3):
        with pytest.raises(ModelLoadError, match="has shape"):
            LLM(str(folder), kv_cache_memory=16 << 20)
        gc.collect()
    assert _rss_mb() - before < 300, f"three failed loads kept {_rss_mb() - before:.0f} MB"
