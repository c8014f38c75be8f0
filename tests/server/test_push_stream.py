"""ChunkPusher (push_stream.py): running outputs sent by the delivery while the handler waits, in order, also
when a send suspends on a full socket; the handler's sends wait for a pushed one; finals are never pushed.

The ASGI send here is a coroutine that can be held (uvicorn's waits on its flow control the same way); the
collector records what it saw. The same path through a real server and socket: test_push_stream_server.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvpilot.outputs import CompletionOutput, RequestOutput
from kvpilot.server.item_stream import ItemStream
from kvpilot.server.push_stream import ChunkPusher
from kvpilot.server.openai.responses import ResponseShape

SHAPE = ResponseShape(False, "cmpl-push", "m", 0)


def output(text: str, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, text, [1], "length" if finished else None)
    return RequestOutput("r", None, [0], [completion], finished, delta_text=text, delta_token_ids=[1])


class Seen:
    def __init__(self) -> None:
        self.texts: list[str] = []

    def saw(self, k: int, item: RequestOutput) -> None:
        assert k == 0
        self.texts.append(item.delta_text)


class HeldSend:
    """An ASGI send that suspends while `held` (a full socket), recording the bodies in the order written."""

    def __init__(self) -> None:
        self.bodies: list[str] = []
        self.open = asyncio.Event()
        self.open.set()
        self.cancelled = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        try:
            await self.open.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.bodies.append(message["body"].decode())


def texts(bodies: list[str]) -> list[str]:
    return [json.loads(body[len("data: "):])["choices"][0]["text"] for body in bodies]


def attached(send: Any) -> tuple[ChunkPusher, ItemStream[Any], Seen]:
    """A pusher sending to `send`, hooked on a stream, as _PushingResponse wires them."""
    seen = Seen()
    pusher, stream = ChunkPusher(SHAPE, seen), ItemStream()  # type: ignore[arg-type]
    pusher.start(send)
    stream.set_push(pusher.push)
    return pusher, stream, seen


async def waiting_consumer(stream: ItemStream[Any]) -> asyncio.Future[Any]:
    getter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0)
    assert not getter.done()
    return getter


def test_running_outputs_are_sent_by_the_put_and_the_consumer_keeps_waiting() -> None:
    async def run() -> None:
        send = HeldSend()
        pusher, stream, seen = attached(send)
        getter = await waiting_consumer(stream)
        for text in ("a", "b", "c"):
            stream.put_nowait(output(text))
        assert texts(send.bodies) == ["a", "b", "c"] and seen.texts == ["a", "b", "c"]
        assert not getter.done() and stream.empty()
        stream.put_nowait(output("d", finished=True))  # a final takes the handler's path
        assert (await getter).finished and texts(send.bodies) == ["a", "b", "c"]
        pusher.stop()

    asyncio.run(run())


def test_an_item_put_while_the_consumer_is_busy_is_queued_not_pushed() -> None:
    async def run() -> None:
        send = HeldSend()
        pusher, stream, _ = attached(send)
        stream.put_nowait(output("a"))  # nobody waits: queued
        stream.put_nowait(output("b"))
        assert send.bodies == [] and stream.qsize() == 2
        assert (await stream.get()).delta_text == "a"

    asyncio.run(run())


def test_a_send_suspended_on_a_full_socket_keeps_the_order_of_the_chunks() -> None:
    async def run() -> None:
        send = HeldSend()
        pusher, stream, seen = attached(send)
        getter = await waiting_consumer(stream)
        stream.put_nowait(output("a"))
        send.open.clear()  # the socket fills
        stream.put_nowait(output("b"))  # pushed, its send suspended: finished by a task
        assert texts(send.bodies) == ["a"] and not getter.done()
        stream.put_nowait(output("c"))  # not pushed while "b" is in flight: the handler gets it
        item = await getter
        assert item.delta_text == "c" and seen.texts == ["a", "b"]
        await asyncio.sleep(0.01)
        assert texts(send.bodies) == ["a"]  # "b" waits on the socket
        send.open.set()  # the client reads again; the handler sends "c" before "b"'s task has resumed
        await pusher.send({"type": "http.response.body", "body": SHAPE.running_chunk("c", None).encode()})
        assert texts(send.bodies) == ["a", "b", "c"]
        getter = await waiting_consumer(stream)  # caught up: pushing resumes
        stream.put_nowait(output("d"))
        assert texts(send.bodies) == ["a", "b", "c", "d"] and not getter.done()
        getter.cancel()
        pusher.stop()

    asyncio.run(run())


def test_stop_cancels_a_send_still_waiting_on_the_socket() -> None:
    async def run() -> None:
        send = HeldSend()
        pusher, stream, _ = attached(send)
        getter = await waiting_consumer(stream)
        send.open.clear()
        stream.put_nowait(output("a"))
        await asyncio.sleep(0)
        pusher.stop()  # the client went away
        await asyncio.sleep(0.01)
        assert send.cancelled == 1 and send.bodies == []
        getter.cancel()

    asyncio.run(run())


def test_a_failed_push_fails_the_handlers_next_send_and_never_the_delivery() -> None:
    async def run() -> None:
        async def broken(message: dict[str, Any]) -> None:
            raise ConnectionError("socket gone")

        pusher, stream, _ = attached(broken)
        getter = await waiting_consumer(stream)
        stream.put_nowait(output("a"))  # raises nothing here: other requests' outputs are being delivered
        stream.put_nowait(output("b"))
        assert (await getter).delta_text == "b"
        with pytest.raises(ConnectionError, match="socket gone"):
            await pusher.send({"type": "http.response.body", "body": b"x"})

    asyncio.run(run())


def test_a_send_that_is_not_a_coroutine_still_goes_out_in_order() -> None:
    async def run() -> None:
        loop, bodies = asyncio.get_running_loop(), []

        def future_send(message: dict[str, Any]) -> asyncio.Future[None]:
            done = loop.create_future()
            loop.call_soon(lambda: (bodies.append(message["body"].decode()), done.set_result(None)))
            return done

        pusher, stream, _ = attached(future_send)
        getter = await waiting_consumer(stream)
        stream.put_nowait(output("a"))  # pushed: in flight as a task
        stream.put_nowait(output("b"))  # queued behind it
        assert (await getter).delta_text == "b"
        await pusher.send({"type": "http.response.body", "body": SHAPE.running_chunk("b", None).encode()})
        assert texts(bodies) == ["a", "b"]

    asyncio.run(run())
