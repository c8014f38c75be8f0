"""Waiting queues for the two scheduling policies: fcfs (arrival order) and priority (lower first)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from kvpilot.engine.request import Request


class RequestQueue(Protocol):
    """Waiting requests; peek/pop give the next one to admit under the policy."""

    def add(self, request: Request, order: int) -> None: ...
    def push_front(self, request: Request, order: int) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FcfsQueue:
    """Arrival order; a preempted request goes back to the front (it arrived before everything waiting)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request, order: int) -> None:
        self._queue.append(request)

    def push_front(self, request: Request, order: int) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest (priority, arrival order) first; a preempted request re-enters at its original place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def add(self, request: Request, order: int) -> None:
        heapq.heappush(self._heap, (request.priority, order, request))

    def push_front(self, request: Request, order: int) -> None:
        self.add(request, order)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[2] for item in sorted(self._heap, key=lambda item: item[:2]))


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling_policy {policy!r}: use 'fcfs' or 'priority'")
