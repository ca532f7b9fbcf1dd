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


def read_chunk(path: Path, offset: int, limit: int = MAX_CHUNK) -> LogChunk:
    """Up to `limit` bytes from `offset` (an offset past the end reads nothing)."""
    size = _size(path)
    offset = min(offset, size)
    data = _read(path, offset, min(limit, MAX_CHUNK))
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
    """Bytes from `offset` on as they are written, until the job has ended and the log is drained."""
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
