"""ItemStream (the EngineClient's per-request channel): order, wake-up, cancellation, one consumer."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.server.item_stream import ItemStream


def test_items_come_out_in_order_and_a_waiting_get_is_woken() -> None:
    async def run() -> list[int]:
        stream: ItemStream[int] = ItemStream()
        stream.put_nowait(1)
        got = [await stream.get()]
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        stream.put_nowait(2)
        stream.put_nowait(3)
        got.append(await waiting)
        assert stream.qsize() == 1 and not stream.empty()
        got.append(stream.get_nowait())
        assert stream.empty()
        with pytest.raises(asyncio.QueueEmpty):
            stream.get_nowait()
        return got

    assert asyncio.run(run()) == [1, 2, 3]


def test_a_cancelled_get_loses_no_item_and_the_next_get_waits_again() -> None:
    async def run() -> int:
        stream: ItemStream[int] = ItemStream()
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        again = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream.put_nowait(7)
        return await again

    assert asyncio.run(run()) == 7


def test_a_second_waiting_consumer_is_refused() -> None:
    async def run() -> None:
        stream: ItemStream[int] = ItemStream()
        first = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one consumer"):
            await stream.get()
        stream.put_nowait(1)
        assert await first == 1

    asyncio.run(run())
