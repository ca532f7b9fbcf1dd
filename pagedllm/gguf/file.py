"""Open a GGUF file with the llama.cpp project's own reader (the `gguf` package) and check it
before anything is built from it.

A GGUF is one file holding what a Hugging Face folder spreads over several: hyper-parameters,
tokenizer and chat template as key/value metadata, and the weights as typed tensors. The header is
read by gguf/header.py (the `gguf` package's reader took ~5 s over the default model's tokenizer
arrays); the file is memory-mapped, so tensor data is touched only when a weight is loaded. Every way a file can be unusable — not GGUF at all, cut short, an architecture or a
tensor type we cannot run — becomes a `ModelLoadError` naming the file and the reason here,
never a crash later in the middle of loading.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.gguf.header import HeaderError, read_header
from pagedllm.load_errors import ModelLoadError

MAGIC = b"GGUF"
# The architectures whose tensors map onto our Llama-family modules (models/llama.py).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Tensor types we read: these dequantize exactly (gguf.quants), and Q4_0 / Q4_1 / Q8_0 can also be
# kept in their blocks for the C kernels (gguf/weights.py).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def is_gguf(path: str | os.PathLike) -> bool:
    """A path names a GGUF model: a file ending in .gguf, or any file starting with its magic."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


@dataclass
class GGUFModel:
    """An opened GGUF: its metadata as Python values and its tensors (memory-mapped, header.TensorInfo)."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf/header.py's TensorInfo
    data_start: int = 0  # where the tensor data begins; each tensor's offset counts from here
    header: Any = None  # gguf/header.py's Header (its memory map)

    def release_pages(self) -> None:
        """Let the OS take back the memory-mapped pages that loading read (header.Header.release_pages)."""
        if self.header is not None:
            self.header.release_pages()

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value: `get("block_count")` reads "llama.block_count"."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.architecture}.{key}")
        return value


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """The checked GGUF at `path`; the same object for the same unchanged file (config, tokenizer
    and weights each ask for it, and parsing the metadata of a 49k-token vocabulary takes ~2 s)."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist or is not a file")
    stat = p.stat()
    return _open(str(p.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int) -> GGUFModel:
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    try:
        header = read_header(path)
    except (HeaderError, ValueError, OverflowError, MemoryError) as exc:
        raise ModelLoadError(f"{path} is truncated or corrupt: {exc}") from exc
    model = GGUFModel(path, header.metadata, header.tensors, header.data_start, header)
    _check(model, size)
    return model


def _end(model: GGUFModel, tensor) -> int:
    """Where the tensor's data ends, in Python integers (which never wrap): an offset or a size
    past 64 bits — 2^64 - 1 would wrap to a small number in a reader's uint64 arithmetic and the
    data be read from the wrong place of a file that looks whole — is refused as corrupt."""
    from gguf import GGML_QUANT_SIZES

    elements = math.prod(tensor.shape)
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    end = tensor.data_offset + elements * type_size // block
    if end >= 2**64:
        raise ModelLoadError(f"{model.path}: tensor {tensor.name!r} has offset {tensor.raw_offset} and {elements} elements, "
                             "which overflow 64 bits: the file is corrupt")
    return end


def _check(model: GGUFModel, size: int) -> None:
    arch = model.metadata.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{model.path}: GGUF metadata lacks general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{model.path}: GGUF architecture {arch!r} is not supported (supported: {list(ARCHITECTURES)})")
    for tensor in model.tensors.values():
        kind = tensor.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ModelLoadError(f"{model.path}: tensor {tensor.name!r} has type {kind}, which pagedllm cannot read "
                                 f"(supported: {', '.join(TENSOR_TYPES)})")
        end = _end(model, tensor)
        if end > size:
            raise ModelLoadError(f"{model.path} is truncated: tensor {tensor.name!r} ends at byte {end}, "
                                 f"the file has {size}")
