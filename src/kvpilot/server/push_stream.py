"""Pushed chunks: a lone stream's running outputs written by the engine client's delivery, no task woken.

A streamed response pulls: each step, the delivery puts the request's output on its ItemStream, which wakes the
handler's task; the task resumes through Starlette's response loop, the event generator and SubRequests,
renders the chunk and awaits the ASGI send, then goes back to waiting. At 64 streams that round trip was a
fifth of the HTTP process's time a token (docs/benchmark-log.md), CPU the engine's threads share on a small
machine.

So while the handler waits on an empty stream, a running output that needs no per-choice state (one choice,
no logprobs, no tool-call parsing, no echo: `can_push`) is rendered and sent by the delivery callback itself,
on the event loop. uvicorn's send returns without suspending unless the client's socket is full; then the
send is finished by a task of its own (`_finish`), nothing else is pushed, and the handler's next send waits
for it first, so chunks keep their order. Finals, errors and everything else take the handler's path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Callable

from kvpilot.outputs import RequestOutput
from kvpilot.server.observe.collector import Collector
from kvpilot.server.prepared import Prepared
from kvpilot.server.openai.responses import ResponseShape

Send = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]


def can_push(prepared: Prepared) -> bool:
    """A response whose running chunks depend on nothing but the output itself (see the module doc)."""
    return (prepared.fanout.size == 1 and prepared.chat_output is None and not prepared.show_logprobs
            and not any(prepared.echo))


class ChunkPusher:
    """Invariants: chunks reach the ASGI send in the order of the outputs; a pushed output was first given to
    the collector, as the handler would have; while a pushed send is unfinished or failed (`_pending`),
    nothing more is pushed, and the handler's sends (`send`) wait for it and raise what it raised; `push`
    never raises (it runs inside the delivery of every request's outputs)."""

    def __init__(self, shape: ResponseShape, collector: Collector) -> None:
        self._shape, self._collector = shape, collector
        self._send: Send | None = None
        self._pending: asyncio.Future[None] | None = None

    def start(self, send: Send) -> None:
        """The response has started: pushes go to `send` from now on."""
        self._send = send

    def stop(self) -> None:
        """The response ended (or was cancelled): a send still waiting on the socket is given up."""
        self._send = None
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.done():
            pending.cancel()
        elif not pending.cancelled():
            pending.exception()  # retrieved: the response is over, nobody else will read it

    async def send(self, message: dict[str, Any]) -> None:
        """The handler's own send: after the pushed one still in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending
        if self._send is None:
            raise RuntimeError("ChunkPusher.send() before start() or after stop()")
        await self._send(message)

    def push(self, item: Any) -> bool:
        """Offered each item while the handler waits on its empty stream (ItemStream.set_push); True when it
        was handled here, False to queue it for the handler."""
        if self._send is None or self._pending is not None or not isinstance(item, RequestOutput) \
                or item.finished:
            return False
        try:
            self._collector.saw(0, item)
            if item.delta_text or item.delta_token_ids:  # a step with no token sends nothing, as _events
                body = self._shape.running_chunk(item.delta_text, None, 0).encode()
                self._drive(self._send({"type": "http.response.body", "body": body, "more_body": True}))
        except Exception as exc:  # noqa: BLE001 - the handler raises it at its next send, as if it had rendered
            self._pending = _failed(exc)
        return True

    def _drive(self, send: Coroutine[Any, Any, None]) -> None:
        """Runs the send coroutine by hand to its end or its first suspension (what a task's first step does)."""
        if not asyncio.iscoroutine(send):  # another ASGI server's awaitable: a task runs it, in order all the same
            self._pending = asyncio.ensure_future(send)
            return
        try:
            awaited = send.send(None)
        except StopIteration:
            return
        self._pending = asyncio.ensure_future(_finish(send, awaited))


async def _finish(coroutine: Coroutine[Any, Any, None], awaited: Any) -> None:
    """Runs a coroutine that suspended when driven by hand to its end, as its task would have: wait for what it
    yielded (a future, or None for a bare yield), resume it, repeat. The coroutine reads the future's outcome
    itself when resumed (Future.__await__ returns its result), so an error surfaces there; cancelling this
    task cancels the future it waits on, or is thrown into it, as Task.cancel does."""
    while True:
        try:
            if awaited is None:
                await asyncio.sleep(0)
            else:
                awaited._asyncio_future_blocking = False  # taken, as Task.__step takes it (else: RuntimeError)
                await awaited
        except asyncio.CancelledError as exc:
            if awaited is None or not awaited.cancelled():  # this task was cancelled, not what it waits on
                try:
                    awaited = coroutine.throw(exc)
                except StopIteration:
                    return
                continue
        except Exception:  # noqa: BLE001, S110 - the coroutine raises it when resumed
            pass
        try:
            awaited = coroutine.send(None)
        except StopIteration:
            return


def _failed(exc: Exception) -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future
