"""The bridge between asyncio and the synchronous `LLMEngine`: one engine thread per model.

The engine is not thread-safe and `step()` blocks for a whole forward pass, so each engine lives
on its own thread and nothing else touches it. HTTP handlers send it commands (add, abort, stop)
through a thread-safe queue; the thread applies them between steps, so requests from many
clients join the running batch at the next step (continuous batching), and it hands each step's
outputs back to the event loop with one `call_soon_threadsafe` per step.

Outputs are cumulative (the full text so far), so a consumer needs only the newest one per
request: a slow client never makes outputs pile up, it just receives bigger deltas.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.server")

StepObserver = Callable[[list[RequestOutput]], None]


class EngineDeadError(RuntimeError):
    """The engine loop raised; its requests were failed and the model must be reloaded."""


class EngineStoppedError(RuntimeError):
    """The model was unloaded (or is being unloaded)."""


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting_requests` requests."""


class Disconnected(Exception):
    """The consumer's cancellation check fired (its HTTP client went away)."""


class RequestTimeout(RuntimeError):
    """The request group outlived its deadline (the server's --request-timeout, queue time included)."""


@dataclass
class _Add:
    group: "RequestGroup"
    prompts: list[tuple[str, PromptType]]
    params: SamplingParams
    arrival_time: float
    priority: int
    lora_request: Any = None  # the adapter the requests run with (lora/request.py)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Query:
    """Asks the engine thread for its live requests' states (the only thread that may read them)."""

    answer: asyncio.Future


@dataclass
class _Call:
    """Runs `fn(engine)` on the engine thread between steps (the engine is not thread-safe:
    embeddings, adapter loads and unloads) and answers with its result or its exception."""

    fn: Callable[[LLMEngine], Any]
    answer: asyncio.Future


_STOP = object()


class RequestGroup:
    """The engine requests of one API call (one per prompt), as seen from the event loop.

    All methods run on the event loop; the engine thread reaches them via call_soon_threadsafe."""

    def __init__(self, request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self.request_ids = request_ids
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        self.outputs: dict[str, RequestOutput] = {}
        self._changed: dict[str, RequestOutput] = {}
        self._open = set(request_ids)
        self._wakeup = asyncio.Event()
        self._error: BaseException | None = None
        self.deadline: float | None = None  # time.monotonic() after which waiting raises RequestTimeout
        self.timeout_s: float | None = None

    @property
    def finished(self) -> bool:
        return not self._open or self._error is not None

    def _accept(self) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None)

    def _update(self, output: RequestOutput) -> None:
        self.outputs[output.request_id] = output
        self._changed[output.request_id] = output
        if output.finished:
            self._open.discard(output.request_id)
        self._wakeup.set()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        if not self.accepted.done():
            self.accepted.set_exception(exc)
        self._wakeup.set()

    async def updates(
        self, is_cancelled: Callable[[], Awaitable[bool]] | None = None, poll_interval: float = 0.25
    ) -> AsyncIterator[list[RequestOutput]]:
        """Yield the outputs that changed since the last yield, until every request finished.

        `is_cancelled` is checked at least every `poll_interval` seconds, also while tokens flow,
        so a vanished client is noticed even if nothing is ever written to it. Past the group's
        deadline it raises RequestTimeout (leaving `submit` then aborts what has not finished)."""
        last_check = time.monotonic()
        while True:
            if self.deadline is not None and time.monotonic() > self.deadline and not self.finished:
                raise RequestTimeout(f"the request did not finish within the server's request timeout "
                                     f"({self.timeout_s:g} s, time in the waiting queue included)")
            if self._changed:
                changed = list(self._changed.values())
                self._changed.clear()
                yield changed
            elif self._error is not None:
                raise self._error
            elif not self._open:
                return
            else:
                self._wakeup.clear()
                wait = poll_interval if self.deadline is None else max(0.0, min(poll_interval, self.deadline - time.monotonic()))
                try:
                    await asyncio.wait_for(self._wakeup.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            if is_cancelled is not None and time.monotonic() - last_check >= poll_interval:
                last_check = time.monotonic()
                if await is_cancelled():
                    raise Disconnected()


class AsyncEngine:
    """Runs `engine` on a daemon thread; `submit()` is the only way requests reach it."""

    def __init__(
        self,
        engine: LLMEngine,
        name: str = "engine",
        max_waiting_requests: int | None = None,
        on_step: StepObserver | None = None,
        request_timeout_s: float | None = None,
    ):
        self.engine = engine
        self.name = name
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout_s = request_timeout_s
        self._on_step = on_step
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._groups: dict[str, RequestGroup] = {}  # engine thread only
        self._stopping = False  # engine thread only
        self._closing = False  # event loop only: no new submissions once unloading began
        self._ended = threading.Event()
        self.stats: dict[str, Any] = engine.get_stats()
        self.error: BaseException | None = None

    # ---- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self.error is None and not self._ended.is_set()

    @asynccontextmanager
    async def submit(
        self,
        prompts: list[tuple[str, PromptType]],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestGroup]:
        """Add one request per (request_id, prompt), all or none; yields their RequestGroup.

        Raises the engine's ValueError (bad input), QueueFullError, EngineDeadError or
        EngineStoppedError before anything runs. Leaving the block — normally, by an exception,
        or by cancellation — aborts whatever has not finished, freeing its KV blocks."""
        if self._closing:
            raise EngineStoppedError(f"model {self.name!r} is being unloaded")
        if self.error is not None:
            raise EngineDeadError(f"the engine of model {self.name!r} stopped: {self.error!r}")
        assert self._loop is not None, "AsyncEngine.start() was not called"
        group = RequestGroup([request_id for request_id, _ in prompts], self._loop)
        if self.request_timeout_s is not None:
            group.timeout_s = self.request_timeout_s
            group.deadline = time.monotonic() + self.request_timeout_s
        self._send(_Add(group, prompts, params, arrival_time or time.time(), priority, lora_request))
        try:
            await group.accepted
            yield group
        finally:
            if not group.finished:
                self._send(_Abort(group.request_ids))

    def abort(self, request_ids: list[str]) -> None:
        self._send(_Abort(request_ids))

    async def request_states(self) -> list[dict[str, Any]]:
        """Each live request's state, timings and counts (LLMEngine.request_states), read on the
        engine thread between steps; none once the engine has ended."""
        if self._ended.is_set():
            return []
        assert self._loop is not None, "AsyncEngine.start() was not called"
        answer = self._loop.create_future()
        self._send(_Query(answer))
        return await answer

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread between two steps (the only thread that may touch the
        engine); its exception is raised here and leaves the engine as it was."""
        if self._closing:
            raise EngineStoppedError(f"model {self.name!r} is being unloaded")
        if self.error is not None:
            raise EngineDeadError(f"the engine of model {self.name!r} stopped: {self.error!r}")
        assert self._loop is not None, "AsyncEngine.start() was not called"
        answer = self._loop.create_future()
        self._send(_Call(fn, answer))
        return await answer

    async def shutdown(self) -> None:
        """Abort every request (each ends with finish_reason "abort") and stop the thread."""
        self._closing = True
        self._commands.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._ended.wait)
            await asyncio.sleep(0)  # let the final deliveries queued on the loop run

    def _send(self, command: Any) -> None:
        self._commands.put(command)
        if self._ended.is_set():  # the thread is gone and may have drained the queue already
            self._reject(command, self._end_error())

    def _end_error(self) -> Exception:
        if self.error is not None:
            return EngineDeadError(f"the engine of model {self.name!r} stopped: {self.error!r}")
        return EngineStoppedError(f"model {self.name!r} was unloaded")

    @staticmethod
    def _reject(command: Any, exc: Exception) -> None:
        if isinstance(command, _Add):
            command.group._fail(exc)
        elif isinstance(command, _Query):
            _answer(command.answer, [])
        elif isinstance(command, _Call):
            _answer_error(command.answer, exc)

    # ---- engine-thread side -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                for command in self._next_commands():
                    self._apply(command)
                if self._stopping:
                    self._abort_all()
                    return
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                self.stats = self.engine.get_stats()
        except BaseException as exc:  # a bug in the engine: fail its requests, report unhealthy
            # The traceback as text: a log record holding its frames (and so the engine) would keep the
            # weights and KV pool alive past unload, as would the error kept here
            logger.error("engine loop of model %r died:\n%s", self.name, traceback.format_exc().rstrip())
            self.error = _without_traceback(exc)
            self._fail_all(exc)
        finally:
            self._shutdown_engine()
            self._ended.set()
            self._drain_rejecting()

    def _fail_all(self, exc: BaseException) -> None:
        """Each unfinished request gets its final output, finished with reason "error" (the
        metrics count them), and then, in the same callback on the event loop, its group gets
        the engine's error: a client never sees its request end without it."""
        outputs: list[RequestOutput] = []
        try:
            outputs = self.engine.fail_unfinished(f"the engine failed: {exc!r}")
            if self._on_step is not None:
                self._on_step(outputs)
        except Exception:
            logger.exception("reporting the failed requests of model %r failed", self.name)
        deliveries = [(self._groups[o.request_id], o) for o in outputs if o.request_id in self._groups]
        dead = EngineDeadError(f"the engine of model {self.name!r} stopped: {exc!r}")
        self._post(_deliver_and_fail, deliveries, set(self._groups.values()), dead)
        self._groups.clear()

    def _shutdown_engine(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # a dead tensor-parallel group cannot say goodbye; its workers are killed
            logger.exception("shutting the engine of model %r down failed", self.name)

    def _next_commands(self) -> list[Any]:
        commands = []
        if not self.engine.has_unfinished_requests():
            commands.append(self._commands.get())  # idle: sleep until there is work
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: Any) -> None:
        if command is _STOP:
            self._stopping = True
        elif isinstance(command, _Query):
            self._post(_answer, command.answer, self.engine.request_states())
        elif isinstance(command, _Call):
            self._call(command)
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                if request_id in self._groups:
                    self.engine.abort_request(request_id)
        elif self._stopping:
            self._post(command.group._fail, EngineStoppedError(f"model {self.name!r} was unloaded"))
        else:
            self._add(command)

    def _call(self, command: _Call) -> None:
        if self._stopping:
            self._post(_answer_error, command.answer, EngineStoppedError(f"model {self.name!r} was unloaded"))
            return
        try:
            result = command.fn(self.engine)
        except Exception as exc:
            self._post(_answer_error, command.answer, _without_traceback(exc))
            return
        self._post(_answer, command.answer, result)

    def _add(self, command: _Add) -> None:
        added: list[str] = []
        try:
            for index, (request_id, prompt) in enumerate(command.prompts):
                self._check_queue()
                try:
                    self.engine.add_request(
                        request_id, prompt, command.params, arrival_time=command.arrival_time, priority=command.priority,
                        lora_request=command.lora_request,
                    )
                except ValueError as exc:
                    raise ValueError(f"prompt {index}: {exc}" if len(command.prompts) > 1 else str(exc)) from exc
                added.append(request_id)
        except Exception as exc:  # add_request validates before queueing: the engine is intact
            for request_id in added:
                self.engine.abort_request(request_id)
            self._post(command.group._fail, exc)
            return
        for request_id in added:
            self._groups[request_id] = command.group
        self._post(command.group._accept)

    def _check_queue(self) -> None:
        limit = self.max_waiting_requests
        if limit is not None and self.engine.get_stats()["num_waiting"] >= limit:
            raise QueueFullError(f"the waiting queue of model {self.name!r} is full ({limit} requests); retry later")

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if self._on_step is not None:
            try:
                self._on_step(outputs)
            except Exception:  # metrics must never take the engine down
                logger.exception("step observer failed")
        deliveries = []
        for output in outputs:
            group = self._groups.get(output.request_id)
            if group is None:
                continue  # a rejected group's abort echo, or a request already failed
            if output.finished:
                del self._groups[output.request_id]
            deliveries.append((group, output))
        if deliveries:
            self._post(_deliver, deliveries)

    def _abort_all(self) -> None:
        for request_id in list(self._groups):
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            self._publish(self.engine.step())
        self.stats = self.engine.get_stats()

    def _drain_rejecting(self) -> None:
        exc = self._end_error()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._post(command.group._fail, exc)
            elif isinstance(command, _Query):
                self._post(_answer, command.answer, [])
            elif isinstance(command, _Call):
                self._post(_answer_error, command.answer, exc)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is exiting
            pass


def _without_traceback(exc: BaseException) -> BaseException:
    """`exc` and the exceptions chained to it, their tracebacks (logged already) dropped."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return exc


def _deliver(deliveries: list[tuple[RequestGroup, RequestOutput]]) -> None:
    for group, output in deliveries:
        group._update(output)


def _answer(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _answer_error(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _deliver_and_fail(deliveries: list[tuple[RequestGroup, RequestOutput]], groups: set[RequestGroup],
                      exc: BaseException) -> None:
    _deliver(deliveries)
    for group in groups:
        group._fail(exc)


