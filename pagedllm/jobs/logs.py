"""A job's log (<data_dir>/jobs/<id>/train.log: every run's stdout and stderr) read by byte offset.

Clients tail it by polling with ?offset=<next_offset>, start from the end with ?tail=<lines>, or keep
one request open with ?follow=true (plain text streamed until the job has ended).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from pagedllm.jobs.schemas import LogChunk

MAX_CHUNK = 1 << 20
TAIL_WINDOW = 4 << 20  # ?tail looks at most this far back


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read(path: Path, offset: int, limit: int) -> bytes:
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read(limit)
    except FileNotFoundError:
        return b""


def _char_length(lead: int) -> int:
    """Bytes of the UTF-8 character starting with `lead` (1 for ASCII and for stray continuation bytes)."""
    return 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1


def whole_characters(data: bytes, limit: int) -> bytes:
    """The longest prefix of `data` of at most `limit` bytes that does not cut a UTF-8 character;
    the first character whole if it alone is longer than `limit` (a reader must always advance)."""
    head = data[:limit]
    for back in range(1, min(4, len(head)) + 1):
        lead = head[-back]
        if lead & 0xC0 != 0x80:  # the first byte of the last character
            if _char_length(lead) <= back:
                return head
            if len(head) > back:
                return head[:-back]
            return data[:_char_length(lead)]
    return head


def read_chunk(path: Path, offset: int, limit: int = MAX_CHUNK) -> LogChunk:
    """Up to `limit` bytes from `offset`, ending on a whole character (past the end: nothing)."""
    size = _size(path)
    offset = min(offset, size)
    limit = min(limit, MAX_CHUNK)
    data = whole_characters(_read(path, offset, limit + 3), limit)
    return LogChunk(offset=offset, next_offset=offset + len(data), size=size, text=data.decode(errors="replace"))


def tail_offset(path: Path, lines: int) -> int:
    """The byte offset where the last `lines` lines begin."""
    size = _size(path)
    start = max(0, size - TAIL_WINDOW)
    data = _read(path, start, size - start)
    cut = len(data)
    if data.endswith(b"\n"):
        cut -= 1
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            return start
    return start + cut + 1


async def follow(path: Path, offset: int, finished: Callable[[], bool], poll_s: float = 0.25) -> AsyncIterator[bytes]:
    """Bytes from `offset` on as they are written, until the job has ended and the log is drained
    (an offset past the end is taken as the end, as `read_chunk` takes it)."""
    offset = min(offset, _size(path))
    while True:
        done = finished()  # checked before reading, so nothing written before the end is missed
        data = _read(path, offset, MAX_CHUNK)
        if data:
            offset += len(data)
            yield data
            continue
        if done:
            return
        await asyncio.sleep(poll_s)
