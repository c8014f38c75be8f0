"""EngineClient: the HTTP side's handle on the engine core (a child process, or a thread with
`--no-engine-process`), talking to it only through the messages of messages.py.

A writer thread pickles what handlers post (a 10 MB prompt takes milliseconds) and hands it to the channel,
which writes what the pipe takes and leaves the rest to its sender thread (pipe_channel.py), so the event loop
never waits on the core. What the
core process sends is read on the event loop itself (`add_reader` on its pipe, non-blocking reads into the
channel's buffer: a step's StepResult is unpickled and delivered in one callback, no thread handing it over,
and a message still arriving never holds the loop); a core thread's in-memory queues are read by a reader
thread, which hands each message to the loop in one `call_soon_threadsafe`. Each output goes to its
request's ItemStream; `on_step` runs for every step, before its outputs. A ChannelWatchdog logs a channel to
the core that stops moving, and `channel_stall` tells /health.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any, Callable

from kvpilot.engine.engine import StepStats
from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.outputs import RequestOutput
from kvpilot.server.core.process import Core, start_core
from kvpilot.server.core.engine_info import EngineInfo
from kvpilot.server.core.engine_spec import EngineFactory, EngineSpec
from kvpilot.server.openai.errors import RequestFailedError
from kvpilot.server.item_stream import ItemStream
from kvpilot.server.core.messages import (Abort, AddRequest, CoreFailed, FromCore, LoadFailed, Query, QueryReply, Ready,
                                     Shutdown, StepResult, ToCore)
from kvpilot.server.core.output_delta import OutputAssembly, OutputDelta
from kvpilot.server.core.pipe_channel import ChannelWatchdog, MessageTooLargeError

logger = logging.getLogger("kvpilot.server")
SHUTDOWN_TIMEOUT_S = 30.0
Item = RequestOutput | BaseException


class EngineDeadError(RuntimeError):
    """The engine core failed (to load, or while running); the message carries the cause. Restart the server."""


class EngineQueryError(RuntimeError):
    """The core answered a query with an error (e.g. a broken scheduler invariant); the message names it."""


class EngineClient:
    """Invariants: every request added gets exactly one final item on its queue (a finished RequestOutput or
    an exception), also when the core dies or shuts down; outputs are rebuilt from the core's deltas with
    the prompt of the AddRequest; `_streams`, `_assemblies` and `_queries` are only touched on the event
    loop; `stats` is the latest scheduler snapshot and `info`/`tokenizer` are set before `ready` (each
    replaced whole, so reading them from any thread is safe); `error` is set at most once."""

    def __init__(self, factory: EngineFactory, in_process: bool = False,
                 on_final: Callable[[RequestOutput], None] | None = None,
                 on_progress: Callable[[str], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        """The core runs in a child process unless `in_process`, or unless `factory` cannot be sent there
        (preloaded weights: engine_factory(args, loaded); any other callable). `on_progress(request_id)`
        runs on the event loop for a request's first item delivered, and for an error (admission uses it to
        free the queue slot once the request runs); `on_final(output)` once per finished request; `on_ready()`
        once the core's start-up facts arrived, before `ready` is set (one-time set-up that needs them)."""
        crosses = isinstance(factory, EngineSpec) and factory.crosses_processes
        if not in_process and not crosses:
            logger.info("the engine core runs in a thread: its factory holds weights already loaded in this "
                        "process (or is not an EngineSpec), which cannot be sent to another process")
        self._factory, self._in_process = factory, in_process or not crosses
        self._on_final, self._on_progress, self._on_step = on_final, on_progress, on_step
        self._on_ready = on_ready
        self._outbox: queue.SimpleQueue[ToCore | None] = queue.SimpleQueue()
        self._streams: dict[str, ItemStream[Item]] = {}
        self._assemblies: dict[str, OutputAssembly] = {}  # each request's output, rebuilt from deltas
        self._queries: dict[int, asyncio.Future[Any]] = {}
        self._query_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core: Core | None = None
        self._reader_fd: int | None = None  # the core process's pipe, read on the loop (None: a reader thread)
        self._watchdog: ChannelWatchdog | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.stats: SchedulerStats | None = None
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None  # the engine's own (Ready), used by the HTTP side to tokenize
        self.core_pid: int | None = None  # the core process (None when it runs in a thread)

    # ---- lifecycle (event loop side) ------------------------------------------------------------------

    def start(self) -> None:
        """Starts the core (it builds the engine: /health answers 503 meanwhile) and what carries its messages."""
        self._loop = asyncio.get_running_loop()
        self._core = start_core(self._factory, self._in_process)
        self.core_pid = self._core.pid
        carriers = [(self._write_forever, "kvpilot-core-writer")]
        self._reader_fd = self._core.endpoint.fileno()
        if self._reader_fd is None:
            carriers.append((self._read_forever, "kvpilot-core-reader"))
        else:
            self._loop.add_reader(self._reader_fd, self._read_ready)
            self._watchdog = ChannelWatchdog(self._core.endpoint)
        for target, name in carriers:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    async def stop(self) -> None:
        """Shutdown: the core aborts what is unfinished and exits; killed if it takes over SHUTDOWN_TIMEOUT_S.
        Requests still waiting afterwards get an EngineDeadError, so nothing hangs."""
        if self._core is None:
            return
        self._stopping = True
        self._outbox.put(Shutdown())
        core = self._core
        # A core still loading has nothing to abort: a process need not finish loading to be stopped.
        timeout_s = SHUTDOWN_TIMEOUT_S if self.ready.is_set() or self.error is not None else 0.5
        if not await asyncio.to_thread(core.join, timeout_s):
            logger.warning("the engine core did not stop within %.1f s: killing it", timeout_s)
            await asyncio.to_thread(core.kill)
        self._outbox.put(None)
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 5)
        if self._watchdog is not None:
            self._watchdog.stop()
        self._read_rest()  # the process is gone: what it sent last is in the pipe, then EOF
        core.endpoint.close()
        self._fail_all(EngineDeadError("the server shut down before the request finished"))

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client was started on (tests submit coroutines to it from other threads)."""
        return self._loop

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def request_ids(self) -> Iterator[str]:
        """The ids of the requests added and not yet finished (sub-requests' own ids)."""
        return iter(self._streams)

    @property
    def channel_stall(self) -> str | None:
        """What /health says while the channel to the core has not moved for the watchdog's limit, else None."""
        watchdog = self._watchdog
        return watchdog.describe() if watchdog is not None and watchdog.stalled else None

    # ---- requests and queries (event loop side) -------------------------------------------------------

    def add(self, message: AddRequest) -> ItemStream[Item]:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}; restart the server")
        stream: ItemStream[Item] = ItemStream()
        self._streams[message.request_id] = stream
        self._assemblies[message.request_id] = OutputAssembly(message.request_id, message.prompt,
                                                              message.prompt_token_ids)
        self._outbox.put(message)
        return stream

    def abort(self, request_ids: list[str] | tuple[str, ...]) -> None:
        live = tuple(r for r in request_ids if r in self._streams)
        if live:
            self._outbox.put(Abort(live))

    def abort_all(self) -> None:
        self.abort(tuple(self._streams))

    async def query(self, make: Callable[[int], Query]) -> Any:
        """Sends `make(query_id)` (e.g. `IntegrityQuery`) and returns the reply's value; EngineQueryError
        with the core's message when it failed, EngineDeadError when the core is gone."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}; restart the server")
        if self._loop is None:
            raise RuntimeError("EngineClient.start() was not called: queries need a running core")
        query_id = next(self._query_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._queries[query_id] = future
        self._outbox.put(make(query_id))
        try:
            return await future
        finally:
            self._queries.pop(query_id, None)

    # ---- delivery (event loop side) -------------------------------------------------------------------

    def _deliver(self, items: list[tuple[str, OutputDelta | BaseException]]) -> None:
        for request_id, received in items:
            assembly = self._assemblies.get(request_id)
            if isinstance(received, OutputDelta):
                if assembly is None:
                    continue  # already ended (e.g. failed when its AddRequest could not be sent)
                item: Item = assembly.add(received)
                first = assembly.num_deltas == 1
            else:
                item, first = received, True
            stream = self._streams.get(request_id)
            if first and self._on_progress is not None:  # the request runs (or ended): once is enough
                self._on_progress(request_id)
            if not isinstance(item, RequestOutput) or item.finished:
                self._streams.pop(request_id, None)
                self._assemblies.pop(request_id, None)
                if isinstance(item, RequestOutput) and self._on_final is not None:
                    self._on_final(item)
            if stream is not None:
                stream.put_nowait(item)

    def _resolve(self, reply: QueryReply) -> None:
        future = self._queries.get(reply.query_id)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(EngineQueryError(reply.error))
        else:
            future.set_result(reply.value)

    def _fail_all(self, error: BaseException) -> None:
        self._deliver([(rid, error) for rid in list(self._streams)])
        for future in self._queries.values():
            if not future.done():
                future.set_exception(error)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed: the server is gone, no one waits for this any more
            pass

    # ---- the carrier threads --------------------------------------------------------------------------

    def _write_forever(self) -> None:
        assert self._core is not None
        while (message := self._outbox.get()) is not None:
            try:
                self._core.endpoint.send(message)
            except OSError:  # the core is gone: the reader reports it
                return
            except MessageTooLargeError as exc:  # the request's own fault: a 400 that says so
                self._on_loop(self._unsendable, message, ValueError(f"the request is too large to pass to the "
                                                                    f"engine core ({exc}): send a shorter prompt"))
            except Exception as exc:  # noqa: BLE001 - a message that does not pickle: fail it, keep the channel
                logger.exception("cannot send %s to the engine core", type(message).__name__)
                self._on_loop(self._unsendable, message, RuntimeError(f"the server could not send the "
                                                                      f"request to the engine core: {exc}"))

    def _unsendable(self, message: ToCore, error: BaseException) -> None:
        if isinstance(message, AddRequest):
            self._deliver([(message.request_id, error)])
        future = self._queries.get(getattr(message, "query_id", -1))
        if future is not None and not future.done():
            future.set_exception(error)

    def _read_forever(self) -> None:
        """The reader thread of a core thread (in-memory queues)."""
        assert self._core is not None
        while True:
            try:
                message = self._core.endpoint.recv()
            except (EOFError, OSError):
                break
            self._dispatch(message, self._on_loop)
        if not self._stopping:
            self._core.join(2.0)
            self._fail(f"{self._core.describe_exit()} unexpectedly")

    def _read_ready(self) -> None:
        """The core process's pipe is readable (on the loop): every whole message there, dispatched here; a
        message still arriving waits in the channel's buffer for the next call."""
        assert self._core is not None
        try:
            messages, eof = self._core.endpoint.read_ready()  # type: ignore[attr-defined]
        except OSError:
            messages, eof = [], True
        for message in messages:
            self._dispatch(message, _call_now)
        if eof:
            self._stop_reading()
            if not self._stopping:
                asyncio.ensure_future(self._reap())

    def _read_rest(self) -> None:
        """After the core process ended: what it sent last, up to the end of the pipe."""
        if self._reader_fd is None or self._core is None:
            return
        self._stop_reading()
        try:
            messages, _ = self._core.endpoint.read_ready(max_bytes=None)  # type: ignore[attr-defined]
        except OSError:
            return
        for message in messages:
            self._dispatch(message, _call_now)

    def _stop_reading(self) -> None:
        if self._reader_fd is not None and self._loop is not None:
            self._loop.remove_reader(self._reader_fd)

    async def _reap(self) -> None:
        """The core process closed its pipe without being asked: reaped off the loop, for the exit code."""
        assert self._core is not None
        await asyncio.to_thread(self._core.join, 2.0)
        self._fail(f"{self._core.describe_exit()} unexpectedly")

    def _dispatch(self, message: FromCore, call: Callable[..., None]) -> None:
        """`call(fn, *args)` runs fn on the event loop: at once when already there, else handed over."""
        if isinstance(message, StepResult):
            for step in message.step_stats:
                if self._on_step is not None:
                    self._on_step(step)
            if message.stats is not None:
                self.stats = message.stats
            items: list[tuple[str, OutputDelta | BaseException]] = [(o.request_id, o) for o in message.outputs]
            items.extend((rid, ValueError(text)) for rid, text in message.rejected)
            items.extend((rid, RequestFailedError(text)) for rid, text in message.failed)
            if items:
                call(self._deliver, items)
        elif isinstance(message, QueryReply):
            call(self._resolve, message)
        elif isinstance(message, Ready):
            self.info, self.tokenizer, self.stats = message.info, message.tokenizer, message.stats
            if self._on_ready is not None:
                try:
                    self._on_ready()
                except Exception:  # noqa: BLE001 - a set-up that failed is done lazily later; serve anyway
                    logger.exception("the server's set-up for the ready engine failed")
            self.ready.set()
        elif isinstance(message, LoadFailed):
            self._fail(message.message)
        elif isinstance(message, CoreFailed):
            self._fail(f"the engine stopped: {message.message}")

    def _fail(self, cause: str) -> None:
        """Marks the engine failed (first cause wins) and ends every waiting request and query with it."""
        if self.error is not None:
            return
        self.error = EngineDeadError(cause)
        logger.error("the engine failed: %s", cause)
        self._on_loop(self._fail_all, EngineDeadError(f"the engine failed: {cause}; restart the server"))


def _call_now(fn: Callable[..., None], *args: Any) -> None:
    fn(*args)
