"""Reading a job log by byte offset: whole characters, tails, following until the job ends."""
from __future__ import annotations

import asyncio

from pagedllm.jobs.logs import follow, read_chunk, tail_offset, whole_characters


def test_chunks_end_on_whole_characters_and_reassemble(tmp_path):
    path = tmp_path / "train.log"
    text = "step 1 ok\nGLHF! 🏖️ done\nstep 2 ök\n"
    path.write_text(text)
    for limit in (1, 2, 3, 5, 7):
        pieces, offset = [], 0
        while (chunk := read_chunk(path, offset, limit)).text:
            assert chunk.offset == offset and chunk.size == len(text.encode())
            pieces.append(chunk.text)
            offset = chunk.next_offset
        assert "".join(pieces) == text, limit
    assert read_chunk(path, 10_000).text == "" and read_chunk(path, 10_000).offset == len(text.encode())
    assert read_chunk(tmp_path / "missing.log", 0).size == 0
    assert whole_characters("🏖x".encode(), 2) == "🏖".encode()  # one character longer than the limit: still advance
    assert whole_characters("ab🏖".encode(), 4) == b"ab"


def test_tail_offset(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("a\nbb\nccc\n")
    assert read_chunk(path, tail_offset(path, 1)).text == "ccc\n"
    assert read_chunk(path, tail_offset(path, 2)).text == "bb\nccc\n"
    assert tail_offset(path, 10) == 0
    path.write_text("a\nbb")  # a last line without its newline yet
    assert read_chunk(path, tail_offset(path, 1)).text == "bb"


def test_follow_streams_until_the_job_has_ended(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("one\n")
    state = {"ended": False}

    async def scenario() -> bytes:
        received = []

        async def writer():
            await asyncio.sleep(0.05)
            with open(path, "a") as file:
                file.write("two\n")
            await asyncio.sleep(0.05)
            state["ended"] = True

        task = asyncio.create_task(writer())
        async for data in follow(path, 0, lambda: state["ended"], poll_s=0.01):
            received.append(data)
        await task
        return b"".join(received)

    assert asyncio.run(scenario()) == b"one\ntwo\n"
