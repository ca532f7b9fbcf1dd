"""The engine-thread bridge with a real tiny engine: all-or-nothing submission, aborts on leaving,
the waiting-queue limit, unloading with requests in flight, and an engine loop that dies."""
from __future__ import annotations

import asyncio
import threading

import pytest

from pagedllm import LLMEngine, SamplingParams
from pagedllm.entrypoints.openai.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
)

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture
def engine(model_dir):
    return LLMEngine.from_engine_args(str(model_dir("llama")), num_kv_blocks=128, max_num_seqs=2)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def started(engine, **kwargs) -> AsyncEngine:
    bridge = AsyncEngine(engine, "tiny", **kwargs)
    bridge.start()
    return bridge


def test_outputs_are_cumulative_and_end_finished(engine):
    async def main():
        bridge = await started(engine)
        seen = []
        async with bridge.submit([("a", [5, 6, 7])], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)) as group:
            async for changed in group.updates():
                seen.extend(changed)
        await bridge.shutdown()
        return seen

    seen = run(main())
    assert seen[-1].finished and len(seen[-1].outputs[0].token_ids) == 6
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths)


def test_rejected_group_is_all_or_nothing(engine):
    async def main():
        bridge = await started(engine)
        with pytest.raises(ValueError, match="prompt 1: .*outside the vocabulary"):
            async with bridge.submit([("ok", [5, 6]), ("bad", [10**6])], LONG):
                pass
        await asyncio.sleep(0.2)  # the first, already added, was aborted on the engine thread
        stats = bridge.stats
        await bridge.shutdown()
        return stats

    stats = run(main())
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0


def test_leaving_the_block_aborts_and_frees_kv(engine):
    async def main():
        seen = []  # every step's outputs, as the engine thread reports them
        bridge = await started(engine, on_step=seen.extend)
        async with bridge.submit([("a", [5, 6, 7])], LONG) as group:
            async for _ in group.updates():
                break
        for _ in range(200):
            if any(o.finished for o in seen):
                break
            await asyncio.sleep(0.01)
        stats = bridge.stats
        await bridge.shutdown()
        return [o for o in seen if o.finished], stats

    finished, stats = run(main())
    assert [o.outputs[0].finish_reason for o in finished] == ["abort"]
    assert len(finished[0].outputs[0].token_ids) < LONG.max_tokens
    assert stats["kv_cache_usage"] == 0 and stats["num_running"] == 0
    assert not engine.has_unfinished_requests()


def test_queue_limit(engine):
    """Requests count as waiting until a step admits them, those added since the last step too."""

    async def main():
        bridge = await started(engine, max_waiting_requests=1)
        with pytest.raises(QueueFullError, match="full"):
            async with bridge.submit([("r1", [5]), ("r2", [6])], LONG):  # r1 still waits when r2 comes
                pass
        async with bridge.submit([("r1", [5])], LONG) as g1, bridge.submit([("r2", [6])], LONG) as g2:
            for group in (g1, g2):  # max_num_seqs=2: both end up running
                async for _ in group.updates():
                    break
            async with bridge.submit([("w1", [7])], LONG):  # waits: the batch is full
                with pytest.raises(QueueFullError, match="full"):
                    async with bridge.submit([("w2", [8])], LONG):
                        pass
        await bridge.shutdown()

    run(main())


def test_shutdown_aborts_in_flight_then_refuses(engine):
    async def main():
        bridge = await started(engine)
        async with bridge.submit([("a", [5]), ("b", [6])], LONG) as group:
            stopper = asyncio.create_task(bridge.shutdown())
            finals = {}
            async for changed in group.updates():
                finals.update({o.request_id: o for o in changed})
            await stopper
        with pytest.raises(EngineStoppedError):
            async with bridge.submit([("c", [5])], LONG):
                pass
        return finals

    finals = run(main())
    assert {o.outputs[0].finish_reason for o in finals.values()} == {"abort"}
    assert not engine.has_unfinished_requests()


def test_engine_loop_death_fails_requests_and_refuses_new_ones(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("injected engine failure")

    async def main():
        bridge = await started(engine)
        monkeypatch.setattr(engine, "step", broken_step)
        with pytest.raises(EngineDeadError, match="injected"):
            async with bridge.submit([("a", [5])], LONG) as group:
                async for _ in group.updates():
                    pass
        assert not bridge.alive
        with pytest.raises(EngineDeadError):
            async with bridge.submit([("b", [5])], LONG):
                pass
        await bridge.shutdown()  # returns at once: the thread is gone

    run(main())


def test_a_dead_engine_finishes_its_requests_with_error_and_lists_none(engine, monkeypatch):
    """The requests in flight when the engine fails get a final output (finish reason "error",
    status failed) before their clients get the engine's error; the observer counts them."""
    observed = []
    looked = threading.Event()  # the engine fails at its first step after the states were read
    step = engine.step

    def failing_step():
        if looked.is_set():
            raise RuntimeError("injected engine failure")
        return step()

    async def main():
        monkeypatch.setattr(engine, "step", failing_step)
        bridge = AsyncEngine(engine, "tiny", on_step=observed.extend)
        bridge.start()
        async with bridge.submit([("a", [5, 6]), ("b", [7])], LONG) as group:
            async for _ in group.updates():
                states = await bridge.request_states()
                looked.set()
                break
            with pytest.raises(EngineDeadError, match="injected"):
                async for _ in group.updates():
                    pass
            finals = [group.outputs[r] for r in group.request_ids]
        assert await bridge.request_states() == []
        await bridge.shutdown()
        return states, finals

    states, finals = run(main())
    assert sorted(s["id"] for s in states) == ["a", "b"] and all(s["status"] == "decoding" for s in states)
    assert all(f.finished and f.status == "failed" for f in finals)
    assert all(c.finish_reason == "error" and "injected" in c.stop_reason for f in finals for c in f.outputs)
    assert {o.request_id for o in observed if o.finished and o.status == "failed"} == {"a", "b"}


def test_call_runs_on_the_engine_thread_between_steps(engine):
    """AsyncEngine.call (what /v1/embeddings uses): fn(engine) on the engine's thread while a
    request runs, its result or exception handed back, the request unharmed; after shutdown, a
    call is refused with EngineStoppedError."""
    async def main():
        bridge = await started(engine)
        async with bridge.submit([("a", [5, 6, 7])], SamplingParams(max_tokens=40, ignore_eos=True)) as group:
            threads = await bridge.call(lambda e: (threading.current_thread().name, e.has_unfinished_requests()))
            with pytest.raises(ValueError, match="the prompt is empty"):
                await bridge.call(lambda e: e.embed([[]]))
            vectors = await bridge.call(lambda e: e.embed([[5, 6, 7]]))
            async for _ in group.updates():
                pass
        final = group.outputs["a"]
        await bridge.shutdown()
        with pytest.raises(EngineStoppedError):
            await bridge.call(lambda e: None)
        return threads, vectors, final

    (thread, busy), vectors, final = run(main())
    assert thread == "engine-tiny" and busy
    assert len(vectors[0].outputs.embedding) == engine.model_config.hidden_size
    assert final.finished and len(final.outputs[0].token_ids) == 40
