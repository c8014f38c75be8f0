"""The HTTP server's sockets. The listening socket is bound before anything slow: `kvpilot serve` on a taken
port fails at once, not after the model has loaded (uvicorn binds only after the app's start-up, which loads
the engine). Every accepted connection has TCP_NODELAY: uvicorn writes a response's head and its body (or
each streamed chunk) as separate writes, and with Nagle's algorithm on, a write waits for the ACK of the one
before, which a client on a kept-alive connection delays by ~40 ms (delayed ACK)."""

from __future__ import annotations

import asyncio
import socket


class PortInUseError(OSError):
    """The address cannot be bound; the message names it and what to do."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for uvicorn (`server.run(sockets=[...])`), or PortInUseError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY only on those
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; is another server running "
                             "there? Stop it or pick another --port") from exc
    sock.set_inheritable(True)
    return sock


class NoDelay(asyncio.Protocol):
    """Mixed into a uvicorn HTTP protocol. Invariant: every TCP connection it serves has TCP_NODELAY, whoever
    created the listening socket (asyncio sets it only on sockets whose proto is IPPROTO_TCP)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):  # not on a Unix socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
