"""Request-body limits as pure ASGI middleware: a size cap (413) and a read deadline (408).

The body is read here, in full, before the app sees it (FastAPI reads a JSON body whole anyway), so the
limits hold for Content-Length and chunked uploads alike: a declared length over the cap is refused before a
byte of the body is read, and a chunked body is counted as it arrives and refused as soon as it passes the
cap. A client that sends its body slower than `timeout_s` in all gets 408. Either way the response carries
`Connection: close`.

The 413 is written at once, then the rest of the body is read and discarded (nginx's "lingering close")
before the connection closes: a socket closed with unread data sends a reset, and a client that reads only
once it has sent the whole body (http.client, requests) would see "connection reset" instead of the 413. The
drain is bounded: a body of up to max_bytes + max(max_bytes, MIN_DRAIN_BYTES) bytes in all, within the same
`timeout_s` deadline; past either the connection is closed (a reset for such a client). Draining is cheap
(about a gigabyte a second on loopback; docs/benchmark-log.md). No drain when the client waits for
`100 Continue` before its body (it never sends it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvpilot.server.openai.errors import APIError

MIN_DRAIN_BYTES = 64 * 1024 * 1024  # a 413'd body is discarded up to this past the limit (or max_bytes, if more)


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class BodyGuard:
    """Invariants: the app never sees a body longer than `max_bytes`, and waits at most `timeout_s` for one;
    after the body, the app's `receive` is the server's (so it still sees `http.disconnect`). A refused
    request's connection is held at most `timeout_s` from its start, reading at most `refused_bytes` of its
    body."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.refused_bytes = max_bytes + max(max_bytes, MIN_DRAIN_BYTES)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            # the body is on its way unless the client waits for "100 Continue"; not worth reading past the bound
            drain = not _expects_continue(scope) and declared <= self.refused_bytes
            await self._refuse(self._too_large(declared), receive, send, deadline if drain else None, declared)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _TooLarge:
            await self._refuse(self._too_large(None), receive, send, deadline, self.refused_bytes - self.max_bytes)
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

    async def _refuse(self, error: APIError, receive: Any, send: Any, deadline: float | None, unread: int) -> None:
        """Sends `error` whole, then (with a `deadline`) discards up to `unread` more body bytes before ending
        the response, whose end closes the connection (Connection: close)."""
        response = error.response()
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if deadline is not None:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(_discard(receive, unread), max(remaining, 0.0))
            except (TimeoutError, _TooLarge, _ClientGone):
                pass  # closed with the body unread: the client may see a reset
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _too_large(self, declared: int | None) -> APIError:
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        return APIError(413, f"the request body has {size}; the limit (--max-request-body-bytes) is "
                             f"{self.max_bytes} bytes: send a shorter prompt", code="request_too_large",
                        headers={"Connection": "close"})


async def _discard(receive: Any, max_bytes: int) -> None:
    """Reads the rest of the body and drops it; _TooLarge past `max_bytes`, _ClientGone if the client left."""
    num_bytes = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        num_bytes += len(message.get("body", b""))
        if num_bytes > max_bytes:
            raise _TooLarge
        if not message.get("more_body", False):
            return


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 rejects a malformed length before the app runs
    return None


def _expects_continue(scope: dict[str, Any]) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"])


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that returns the whole body once, then defers to the server's."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed
