"""Bind the listening socket before anything slow: `kvpilot serve` on a taken port fails at once, not after
the model has loaded (uvicorn binds only after the app's start-up, which loads the engine)."""

from __future__ import annotations

import socket


class PortInUseError(OSError):
    """The address cannot be bound; the message names it and what to do."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for uvicorn (`server.run(sockets=[...])`), or PortInUseError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
