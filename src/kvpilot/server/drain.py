"""Graceful shutdown: stop admitting (503), let in-flight requests finish up to the drain timeout, abort the rest.

Hooked into uvicorn's signal handling by `DrainingServer`: the first SIGTERM/SIGINT starts the drain and the
server exits once it is done; a second SIGINT still forces exit (uvicorn's behaviour).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from kvpilot.server.state import ServerState

logger = logging.getLogger("kvpilot.server")
POLL_S = 0.05


async def drain(state: ServerState, timeout_s: float) -> int:
    """Returns how many requests had to be aborted at the deadline (0 = all finished)."""
    state.draining = True
    deadline = time.monotonic() + timeout_s
    logger.info("draining: %d requests in flight, up to %.1f s", state.client.num_in_flight, timeout_s)
    while state.client.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    aborted = state.client.num_in_flight
    if aborted:
        logger.warning("drain timeout: aborting %d unfinished requests", aborted)
        state.client.abort_all()
        end = time.monotonic() + 5.0
        while state.client.num_in_flight and time.monotonic() < end:  # let the abort outputs reach clients
            await asyncio.sleep(POLL_S)
    # Responses already ended need a moment to flush their last bytes before the sockets close.
    await asyncio.sleep(POLL_S)
    return aborted


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the listening socket at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving and the exit code
        # would be the signal's instead of 0.
        logger.info("%s received: draining (new requests get 503)", signal.Signals(sig).name)
        # A plain signal handler runs between bytecodes: wake the loop's selector through the self-pipe.
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_future()
        loop.call_soon_threadsafe(self._start_drain, loop)

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        self._drain_task = loop.create_task(self._drain_then_exit())

    async def on_tick(self, counter: int) -> bool:
        """uvicorn asks every 0.1 s whether to exit: also when the engine failed to load or died."""
        return self._state.client.error is not None or await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self._state, self._drain_timeout_s)
        finally:
            self.should_exit = True
