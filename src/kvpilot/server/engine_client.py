"""EngineClient: the one thread that owns the LLMEngine, and the asyncio side that talks to it.

The engine is not thread-safe, so only its thread touches it. HTTP handlers send small messages through a
thread-safe queue (processed between steps); each step's outputs go back to the event loop in one
`call_soon_threadsafe`, and from there to each request's asyncio.Queue. The thread sleeps on the message
queue when there is no work, so an idle server costs nothing, and a step never waits for a slow client.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from kvpilot.engine.engine import LLMEngine, StepStats
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.model.errors import ModelLoadError
from kvpilot.outputs import RequestOutput
from kvpilot.server.messages import Abort, AddRequest, Call, EngineMessage, Shutdown
from kvpilot.server.served_engine import ServedEngine

logger = logging.getLogger("kvpilot.server")

EngineFactory = Callable[[], ServedEngine]


class EngineDeadError(RuntimeError):
    """The engine thread failed; the message carries the cause. The server must be restarted."""


class EngineClient:
    """Invariants: every request added gets exactly one final item on its queue (a finished RequestOutput
    or an exception); `streams` is only touched on the event loop; `stats` is the latest scheduler snapshot
    (replaced whole, so reading it from any thread is safe)."""

    def __init__(self, factory: EngineFactory, on_final: Callable[[RequestOutput], None] | None = None,
                 on_progress: Callable[[str], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        """`on_progress(request_id)` runs on the event loop for every item delivered (admission uses it to
        free the queue slot once the request runs); `on_final(output)` once per finished request."""
        self._factory = factory
        self._messages: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._on_final = on_final
        self._on_progress = on_progress
        self._on_step = on_step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.served: ServedEngine | None = None  # set (once) by the engine thread before `ready`
        self.error: BaseException | None = None
        self.stats: SchedulerStats | None = None
        self._live: set[str] = set()  # engine thread only: requests added and not yet finished

    # ---- lifecycle (event loop side) ------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread; the engine is built there (the server answers /health 503 meanwhile)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._messages.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event loop side) -------------------------------------------------------------------

    def add(self, message: AddRequest) -> asyncio.Queue[RequestOutput | BaseException]:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}; restart the server")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[message.request_id] = stream
        self._messages.put(message)
        return stream

    def abort(self, request_ids: list[str] | tuple[str, ...]) -> None:
        live = tuple(r for r in request_ids if r in self._streams)
        if live:
            self._messages.put(Abort(live))

    def abort_all(self) -> None:
        self.abort(tuple(self._streams))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs fn(engine) between steps in the engine thread and returns its result (or raises its error)."""
        assert self._loop is not None, "start() first"
        future: asyncio.Future[Any] = self._loop.create_future()

        def reply(result: Any, error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        self._messages.put(Call(fn, lambda r, e: self._loop.call_soon_threadsafe(reply, r, e)))  # type: ignore[union-attr]
        return await future

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if self._on_progress is not None:
                self._on_progress(request_id)
            final = not isinstance(item, RequestOutput) or item.finished
            if final:
                self._streams.pop(request_id, None)
                if isinstance(item, RequestOutput) and self._on_final is not None:
                    self._on_final(item)
            if stream is not None:
                stream.put_nowait(item)

    def _send(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    # ---- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            served = self._factory()
            if self._on_step is not None:
                served.engine.on_step = self._on_step
            self.stats = served.engine.scheduler.make_stats()
            self.served = served
        except BaseException as exc:  # reported through /health and every request
            if isinstance(exc, (ModelLoadError, ValueError, OSError)):  # user errors: the message says what to do
                logger.error("loading the engine failed: %s", exc)
            else:
                logger.exception("loading the engine failed")
            self.error = exc
            return
        self.ready.set()
        try:
            self._loop_forever(served.engine)
        except BaseException as exc:
            logger.exception("the engine loop failed")
            self.error = exc
            self._send([(rid, EngineDeadError(f"the engine stopped: {exc}")) for rid in list(self._streams)])

    def _loop_forever(self, engine: LLMEngine) -> None:
        while True:
            first = None if engine.has_unfinished_requests() else self._messages.get()  # sleep when idle
            if not self._handle_messages(engine, first):
                return
            outputs = engine.step() if engine.has_unfinished_requests() else []
            self._live.difference_update(o.request_id for o in outputs if o.finished)
            # Snapshot before delivering: a client that got its final output then scrapes sees the state after.
            self.stats = engine.scheduler.make_stats()
            self._send([(o.request_id, o) for o in outputs])

    def _handle_messages(self, engine: LLMEngine, first: EngineMessage | None) -> bool:
        """Processes every queued message; False on Shutdown."""
        pending = [first] if first is not None else []
        while True:
            try:
                pending.append(self._messages.get_nowait())
            except queue.Empty:
                break
        errors: list[tuple[str, RequestOutput | BaseException]] = []
        for message in pending:
            if isinstance(message, Shutdown):
                engine.abort_request(sorted(self._live))
                self._send([(o.request_id, o) for o in engine.step()] if engine.has_unfinished_requests() else [])
                return False
            if isinstance(message, AddRequest):
                try:
                    engine.add_request(message.prompt, message.params, request_id=message.request_id,
                                       priority=message.priority, arrival_time=message.arrival_time,
                                       prompt_token_ids=message.prompt_token_ids)
                    self._live.add(message.request_id)
                except ValueError as exc:  # too long for the cache, duplicate id: the request's own fault
                    errors.append((message.request_id, exc))
            elif isinstance(message, Abort):
                engine.abort_request(list(message.request_ids))
            elif isinstance(message, Call):
                try:
                    message.reply(message.fn(engine), None)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    message.reply(None, exc)
        self._send(errors)
        return True
