"""Endpoints of the two-way message channel between the HTTP side and the engine core.

The same interface (send / recv / poll / close, like multiprocessing's Connection) over two carriers:
`PipeEndpoint` (pipe_channel.py), two one-way OS pipes (pickled messages, written by a sender thread) to the
core process; `queue_endpoint_pair`, two in-memory queues (messages passed by reference) to the core thread.
The core loop and the server's reader are written once against `Endpoint`.
"""

from __future__ import annotations

import queue
from typing import Any, Protocol


class Endpoint(Protocol):
    """Invariants: messages arrive in the order sent; `send` never waits for the peer to read; once the
    other side closed (or its process died), `poll()` is True and `recv()` raises EOFError; `send` to a
    closed peer raises OSError (process) or is dropped (thread)."""

    def send(self, message: Any) -> None: ...

    def stalled_s(self) -> float:
        """How long messages sent from this side have waited on a peer that does not read (0.0: none)."""
        ...

    def recv(self) -> Any: ...

    def fileno(self) -> int | None:
        """The descriptor that turns readable when a message arrives (an event loop can watch it), or None
        when there is none (in-memory queues: read them from a thread)."""
        ...

    def poll(self) -> bool: ...

    def close(self) -> None: ...


class _Closed:
    """Put on the peer's queue by `close()`: the peer's recv raises EOFError from then on."""


class QueueEndpoint:
    """One side of the core thread's channel (two SimpleQueues shared with the peer)."""

    def __init__(self, incoming: queue.SimpleQueue[Any], outgoing: queue.SimpleQueue[Any]) -> None:
        self._in, self._out = incoming, outgoing
        self._eof = False

    def send(self, message: Any) -> None:
        self._out.put(message)

    def recv(self) -> Any:
        if self._eof:
            raise EOFError("the other side closed the channel")
        message = self._in.get()
        if isinstance(message, _Closed):
            self._eof = True
            raise EOFError("the other side closed the channel")
        return message

    def poll(self) -> bool:
        return self._eof or not self._in.empty()

    def stalled_s(self) -> float:
        return 0.0  # a queue never fills

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        self._out.put(_Closed())


def queue_endpoint_pair() -> tuple[QueueEndpoint, QueueEndpoint]:
    """(server side, core side) of an in-memory channel."""
    to_core: queue.SimpleQueue[Any] = queue.SimpleQueue()
    from_core: queue.SimpleQueue[Any] = queue.SimpleQueue()
    return QueueEndpoint(from_core, to_core), QueueEndpoint(to_core, from_core)
