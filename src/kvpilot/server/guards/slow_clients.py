"""Timeouts for clients that send their request line and headers slowly (or not at all).

uvicorn's HTTP protocols bound only the idle time between requests (`timeout_keep_alive`, armed after a
response): a connection that opens and then sends nothing, or a few header bytes now and then, is held
forever. `header_timeout_protocol` returns uvicorn's protocol class with a header deadline added: such a
connection is closed after `header_timeout_s` (408 if part of a request had arrived). It also bounds the
request line and headers to MAX_HEADER_BYTES (431 and closed past it): h11 refuses past its own 16 KiB buffer
(400), httptools' parser has no bound. The body's own deadline is BodyGuard's.

The protocol is httptools' (its C parser) where the package is installed, else h11's: streaming 64 requests,
the HTTP process spent a fifth less a streamed chunk with httptools (benchmarks/server_overhead.py;
docs/benchmark-log.md), CPU the engine's threads share on a small machine and the one core the front end has
at hundreds of GPU streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpilot.server.config import ServerArgs
from kvpilot.server.guards.listen import NoDelay

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: h11 alone
    HttpToolsProtocol = None


MAX_HEADER_BYTES = 16 * 1024  # h11's default bound on an incomplete request head, kept for httptools


class _HeaderTimeout(asyncio.Protocol):
    """Mixed into a uvicorn HTTP protocol (both keep `loop`, `transport` and `cycle`, the request being served,
    and call on_response_complete after each response). Invariant: from the moment a connection opens or
    finishes a response, the next request's headers must arrive within `header_timeout_s`, or the connection
    is closed."""

    header_timeout_s: float = 10.0
    _armed_cycle: Any = None  # the request cycle when the deadline was last armed (None: none yet)
    _header_bytes = 0  # bytes received since then while no request head was complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        self._bytes_since_armed = True
        if self._waiting_for_headers():
            self._header_bytes += len(data)
        super().data_received(data)
        # after the parser saw them: bytes past the end of the headers (a body's start) do not count
        if self._header_bytes > MAX_HEADER_BYTES and self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.write(_closing_response(b"431 Request Header Fields Too Large",
                                                   f"the request line and headers exceed {MAX_HEADER_BYTES} bytes"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._bytes_since_armed = False
        self._header_bytes = 0
        self._armed_cycle = self.cycle
        # a re-arm cancels this timer first: when it fires, it belongs to the arm in _armed_cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _waiting_for_headers(self) -> bool:
        """No request has arrived whole since the timer was armed (the protocols set `cycle` once a request's
        headers are parsed; the armed one, if any, has been answered)."""
        armed = self._armed_cycle
        return self.cycle is armed and (armed is None or armed.response_complete)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        if not self._waiting_for_headers() or self.transport.is_closing():
            return  # a request arrived in time (its response re-arms the timer)
        if self._bytes_since_armed:
            late = f"the request line and headers did not arrive within {self.header_timeout_s:g} s"
            self.transport.write(_closing_response(b"408 Request Timeout", late))
        self.transport.close()


def _closing_response(status: bytes, message: str) -> bytes:
    """A whole plain-text response that announces the connection's close (written before the app runs)."""
    body = f"{message}\n".encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def header_timeout_protocol(header_timeout_s: float, parser: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol for `parser` ("httptools", "h11", or "auto": httptools where installed) with the
    header deadline and TCP_NODELAY (listen.py). ValueError for httptools when it is not installed."""
    if parser == "auto":
        parser = "h11" if HttpToolsProtocol is None else "httptools"
    if parser == "httptools" and HttpToolsProtocol is None:
        raise ValueError("the httptools parser needs the httptools package: pip install httptools")
    base = {"h11": H11Protocol, "httptools": HttpToolsProtocol}[parser]
    return type(f"HeaderTimeout{base.__name__}", (_HeaderTimeout, NoDelay, base),
                {"header_timeout_s": header_timeout_s})


def uvicorn_options(args: ServerArgs) -> dict[str, Any]:
    """The uvicorn.Config settings that bound slow clients (used by `kvpilot serve` and BackgroundServer).
    The loop is pinned to asyncio: uvicorn would pick uvloop where installed (Ray Serve brings it), and the
    protocols above are written against asyncio's transports (uvloop saved no CPU a chunk here either)."""
    return {"http": header_timeout_protocol(args.header_timeout_s), "timeout_keep_alive": args.keep_alive_timeout_s,
            "loop": "asyncio"}
