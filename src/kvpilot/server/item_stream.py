"""ItemStream: a request's outputs on their way from the EngineClient to the one handler that reads them.

asyncio.Queue serves any number of producers and consumers, bounded or not, and pays for it on every item
(~25 Python calls a put and get: waiter deques, full/empty checks, wake-up bookkeeping). Here each stream has
one producer (the client's delivery, on the event loop) and one consumer (the request's handler), so a deque
and at most one waiting future do: a streamed token crosses it in a handful of calls.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class ItemStream(Generic[T]):
    """Unbounded FIFO on one event loop, asyncio.Queue's names. Invariants: items come out in the order they
    were put; at most one `get()` waits at a time (a single consumer); `put_nowait` never blocks; a `get()`
    cancelled while waiting loses no item; an item the push hook took is never queued."""

    __slots__ = ("_items", "_waiter", "_push")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._push: Callable[[T], bool] | None = None

    def set_push(self, push: Callable[[T], bool] | None) -> None:
        """`push(item)` is offered each item put while the consumer waits on the empty stream (it has caught
        up: nothing is queued or being handled); True means it handled the item, which is then not queued and
        does not wake the consumer (push_stream.py). None removes it."""
        self._push = push

    def put_nowait(self, item: T) -> None:
        waiter = self._waiter
        if waiter is not None and self._push is not None and not waiter.done() and self._push(item):
            return
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T:
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("ItemStream has one consumer: another get() is already waiting")
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled: nothing woke it
                    self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
