"""Request-body limits as pure ASGI middleware: a size cap (413) and a read deadline (408).

The body is read here, in full, before the app sees it (FastAPI reads a JSON body whole anyway), so the
limits hold for Content-Length and chunked uploads alike: a declared length over the cap is refused before a
byte of the body is read, and a chunked body is counted as it arrives and refused as soon as it passes the
cap. A client that sends its body slower than `timeout_s` in all gets 408. Either way the response carries
`Connection: close`, so the unread rest of the body is never read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvpilot.server.errors import APIError


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class BodyGuard:
    """Invariants: the app never sees a body longer than `max_bytes`, and waits at most `timeout_s` for one;
    after the body, the app's `receive` is the server's (so it still sees `http.disconnect`)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(declared)(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _TooLarge:
            await self._too_large(None)(scope, receive, send)
            return
        except TimeoutError:
            error = APIError(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                  "(the server's --body-timeout)", code="request_timeout",
                             headers={"Connection": "close"})
            await error.response()(scope, receive, send)
            return
        except _ClientGone:
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Any) -> bytes:
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, declared: int | None) -> Any:
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        return APIError(413, f"the request body has {size}; the limit (--max-request-body-bytes) is "
                             f"{self.max_bytes} bytes: send a shorter prompt", code="request_too_large",
                        headers={"Connection": "close"}).response()


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 rejects a malformed length before the app runs
    return None


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that returns the whole body once, then defers to the server's."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed
