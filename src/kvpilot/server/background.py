"""BackgroundServer: the app under uvicorn in a daemon thread on 127.0.0.1 and a free port (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any, Coroutine, TypeVar

import uvicorn
from fastapi import FastAPI

from kvpilot.omp_pool import release_omp_pool
from kvpilot.server.guards.slow_clients import uvicorn_options
from kvpilot.server.state import ServerState

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bound_socket(host: str) -> socket.socket:
    """A TCP socket bound to a free port of ``host`` (listening starts when the server takes it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


class BackgroundServer:
    """Context manager; on enter the server listens and (with wait_ready) the engine is loaded.

    Signal handling stays with the main thread (uvicorn installs none off it); `stop()` ends the server.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None,
                 wait_ready: bool = True, timeout_s: float = 120.0) -> None:
        self.app = app
        # Without a port, the socket is bound here and handed to uvicorn: a port found free and bound later by
        # uvicorn could be taken in between (an outgoing connection's local port: seen once in a CI run).
        self._sock = None if port else _bound_socket(host)
        self.host, self.port = host, port or int(self._sock.getsockname()[1])
        self.wait_ready, self.timeout_s = wait_ready, timeout_s
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, **uvicorn_options(app.state.kvpilot.args))
        self.server = uvicorn.Server(config)
        sockets = None if self._sock is None else [self._sock]
        self._thread = threading.Thread(target=self.server.run, args=(sockets,), name="kvpilot-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> ServerState:
        return self.app.state.kvpilot

    def __enter__(self) -> BackgroundServer:
        # An engine core thread sharing weights this thread used would otherwise run every OpenMP region
        # next to this thread's idle pool, at about half speed on a small host (kvpilot/omp_pool.py).
        release_omp_pool()
        self._thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        if self.wait_ready:
            while not self.state.client.ready.wait(0.05):
                if self.state.client.error is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not load: {self.state.client.error}")
        return self

    def run_on_loop(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Runs `coroutine` on the server's event loop (e.g. `state.client.query(CapacityQuery)`) and
        returns its result; for callers in other threads (tests)."""
        loop = self.state.client.loop
        if loop is None:
            coroutine.close()
            raise RuntimeError("the server is not running: enter the BackgroundServer first")
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(self.timeout_s)
        if self._sock is not None:
            self._sock.close()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
