"""A GGUF file's header — metadata and tensor directory — read in one pass over a memory map.

Why not the `gguf` package's `GGUFReader`: it builds a numpy view (a memmap slice) for every
element of every array field, and the default model's tokenizer alone has two arrays of ~49k
strings: 147k nested parses and 1.2 M memmap slices, ~5 s of a ~12 s start-up on a loaded
2-core machine. Here a string array is one loop of `struct` reads over the mapped bytes and a
numeric array is one `np.frombuffer`, which reads the same header in well under a second. The
format is small and stable (GGUF v2/v3: little-endian, u64 lengths), and the `gguf` package
still supplies the type enums and block sizes, and dequantizes.

Any way the bytes can fail to be a header (cut short, a length past the end, bad UTF-8, an
unknown type code) raises `HeaderError`, which gguf/file.py turns into a `ModelLoadError`
naming the file.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_ALIGNMENT = 32
# GGUF value type code -> (struct format, numpy dtype) of the fixed-size types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


class HeaderError(ValueError):
    """The bytes are not a well-formed GGUF header."""


@dataclass
class TensorInfo:
    """One tensor of the directory. `shape` lists dimensions innermost first (GGUF's order);
    `raw_offset` is the header's offset, counted from the start of the tensor data."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    raw_offset: int
    data_offset: int  # in the file
    buffer: Any = field(repr=False, default=None)  # the file's memory map (np.memmap, read-only)

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def n_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements * type_size // block

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as the `gguf` package's reader shapes them: float arrays for F32 /
        F16, else uint8 rows of blocks (gguf.quants reads either). A view of the map: no copy."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        dims = tuple(reversed(self.shape))
        raw = self.buffer[self.data_offset : self.data_offset + self.n_bytes]
        if self.tensor_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(dims)
        if self.tensor_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(dims)
        return raw.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))


@dataclass
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int  # where the tensor data begins (aligned)
    buffer: Any = field(repr=False, default=None)  # the tensors' memory map

    def release_pages(self) -> None:
        """Drop the map's pages from this process (MADV_DONTNEED): what was read stays in the
        OS's page cache and is faulted back in if read again, but no longer counts as this
        process's memory. Called once the weights are loaded: a kept-quantized model's blocks
        have been copied into the kernels' panels by then."""
        region = getattr(self.buffer, "_mmap", None)
        if region is not None and hasattr(mmap, "MADV_DONTNEED"):
            region.madvise(mmap.MADV_DONTNEED)


class _Cursor:
    """Reads little-endian values from `buf` at a moving offset, bounds-checked."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise HeaderError(f"the header runs past the end of the file (at byte {start}, {n} more wanted)")
        self.pos = start + n
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        start = self.take(length)
        try:
            return bytes(self.buf[start : start + length]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HeaderError(f"a string at byte {start} is not UTF-8: {exc}") from None

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise HeaderError(f"unknown GGUF value type {kind}")

    def array(self) -> list[Any]:
        kind, count = self.scalar("<I"), self.scalar("<Q")
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind][1])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
        if kind == _STRING:
            return self._strings(count)
        if count > self.size:  # each element takes at least one byte
            raise HeaderError(f"an array claims {count} elements, more than the file has bytes")
        return [self.value(kind) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` strings: the hot loop of a tokenizer's vocabulary, kept to a few operations."""
        if count * 8 > self.size:
            raise HeaderError(f"a string array claims {count} elements, more than the file can hold")
        buf, size, pos, unpack = self.buf, self.size, self.pos, struct.Struct("<Q").unpack_from
        out = []
        try:
            for _ in range(count):
                (length,) = unpack(buf, pos)
                end = pos + 8 + length
                if end > size:
                    raise HeaderError(f"a string at byte {pos} runs past the end of the file")
                out.append(str(buf[pos + 8 : end], "utf-8"))
                pos = end
        except struct.error:
            raise HeaderError("a string array runs past the end of the file") from None
        except UnicodeDecodeError as exc:
            raise HeaderError(f"a string near byte {pos} is not UTF-8: {exc}") from None
        self.pos = pos
        return out


def read_header(path: str) -> Header:
    """The metadata (as Python values: strings, numbers, lists) and the tensor directory of the
    GGUF at `path`; the tensors' data stays in the read-only memory map until read."""
    from gguf import GGMLQuantizationType

    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cursor = _Cursor(mapped, len(mapped))
        try:
            cursor.take(4)  # the magic (gguf/file.py checked it)
            version, tensor_count, kv_count = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
            if version not in (2, 3):
                raise HeaderError(f"GGUF version {version} is not supported (2 or 3)")
            metadata = {}
            for _ in range(min(kv_count, len(mapped))):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.scalar("<I"))
            infos = []
            for _ in range(min(tensor_count, len(mapped))):
                name = cursor.string()
                n_dims = cursor.scalar("<I")
                if n_dims > 8:
                    raise HeaderError(f"tensor {name!r} has {n_dims} dimensions")
                dims = tuple(cursor.scalar("<Q") for _ in range(n_dims))
                code, offset = cursor.scalar("<I"), cursor.scalar("<Q")
                try:
                    kind = GGMLQuantizationType(code)
                except ValueError:
                    raise HeaderError(f"tensor {name!r} has an unknown type code {code}") from None
                infos.append((name, kind, dims, offset))
        except struct.error as exc:
            raise HeaderError(f"the header runs past the end of the file: {exc}") from None
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT) or DEFAULT_ALIGNMENT)
        data_start = -(-cursor.pos // alignment) * alignment
    finally:
        mapped.close()
    buffer = np.memmap(path, dtype=np.uint8, mode="r") if infos else None
    tensors: dict[str, TensorInfo] = {}
    for name, kind, dims, offset in infos:
        if name in tensors:
            raise HeaderError(f"tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, kind, dims, offset, data_start + offset, buffer)
    return Header(version, metadata, tensors, data_start, buffer)
