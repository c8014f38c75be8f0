"""The header deadline (slow_clients.header_timeout_protocol) holds on both of uvicorn's HTTP parsers: `kvpilot
serve` takes httptools where it is installed and h11 otherwise. A real uvicorn server with a two-line ASGI app
per parser: a silent connection is closed, half-sent headers get a 408, a whole request is answered and its
connection kept alive, a malformed Content-Length is refused with a 400 and a request head past MAX_HEADER_BYTES
with a 4xx, both before the app runs."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpilot.server.background import free_port
from kvpilot.server.guards.slow_clients import MAX_HEADER_BYTES, HttpToolsProtocol, header_timeout_protocol

TIMEOUT_S = 0.5
PARSERS = ["h11", pytest.param("httptools", marks=pytest.mark.skipif(HttpToolsProtocol is None,
                                                                     reason="httptools is not installed"))]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    calls.append(scope["path"])
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


calls: list[str] = []


@pytest.fixture(params=PARSERS)
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, loop="asyncio", log_level="warning",
                            http=header_timeout_protocol(TIMEOUT_S, request.param), timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Sends data, then reads until the server closes the connection: (all it sent, seconds it took)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - started


def _response(sock: socket.socket) -> bytes:
    """One whole response of _app (its body is the last 2 bytes)."""
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def test_auto_picks_httptools_where_installed() -> None:
    protocol = header_timeout_protocol(TIMEOUT_S)
    assert issubclass(protocol, H11Protocol if HttpToolsProtocol is None else HttpToolsProtocol)
    assert HttpToolsProtocol is None or not issubclass(protocol, H11Protocol)


@pytest.mark.parametrize("sent", [b"", b"GET /x HTTP/1.1\r\nHost: t\r\n"], ids=["silent", "half-sent"])
def test_slow_headers_are_dropped(port: int, sent: bytes) -> None:
    reply, seconds = _exchange(port, sent)
    assert reply.startswith(b"HTTP/1.1 408 ") if sent else reply == b""
    assert TIMEOUT_S * 0.8 < seconds < TIMEOUT_S + 5


def test_a_request_in_time_is_answered_and_the_next_one_gets_its_own_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /first HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(TIMEOUT_S * 0.5)  # the connection stays open past half the deadline...
        sock.sendall(b"GET /second HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        assert sock.recv(65536) == b""  # ...and idle after its second response, it is closed at the deadline
        assert time.monotonic() - started < TIMEOUT_S + 5
    assert calls[-2:] == ["/first", "/second"]


def test_a_malformed_content_length_gets_400_before_the_app(port: int) -> None:
    before = len(calls)
    reply, _ = _exchange(port, b"POST /bad HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert len(calls) == before


def _headers(num_bytes: int) -> bytes:
    """Header lines of about num_bytes (100-byte values)."""
    return b"".join(b"x-pad-%d: %s\r\n" % (i, b"v" * 100) for i in range(num_bytes // 112))


def test_an_endless_request_head_is_refused_past_the_bound(port: int) -> None:
    """Header lines that keep coming (no blank line): refused once over the bound, well before the deadline,
    instead of buffered for as long as they come."""
    before = len(calls)
    reply, seconds = _exchange(port, b"GET /endless HTTP/1.1\r\nHost: t\r\n" + _headers(4 * MAX_HEADER_BYTES))
    assert reply.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 400 "))  # httptools: ours; h11: its own 16 KiB bound
    assert seconds < TIMEOUT_S and len(calls) == before


def test_headers_under_the_bound_and_a_body_sent_with_them_are_served(port: int) -> None:
    body = b"b" * (4 * MAX_HEADER_BYTES)  # in the same send as the headers: not counted as header bytes
    head = b"POST /big-body HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + _headers(MAX_HEADER_BYTES // 2) + b"\r\n" + body)
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
    assert calls[-1] == "/big-body"
