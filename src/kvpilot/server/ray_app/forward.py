"""One HTTP request carried from the ingress to a replica as plain data, and served there by kvpilot's own
ASGI app in process (no second HTTP hop, no port per replica).

call_asgi yields a ResponseStart, then the body's chunks as the app sends them (SSE events stream through).
The app's `receive` gives the body once, then blocks until the caller goes away (the generator is closed or
cancelled), then says `http.disconnect`: kvpilot aborts a request whose client disconnected, so a
disconnect must never be reported early.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade", "te",
                        "trailer", "proxy-authenticate", "proxy-authorization", "host"})
_RUNNING: set[asyncio.Task[Any]] = set()  # apps still finishing after their caller left (kept from the GC)


@dataclass(frozen=True)
class ForwardedRequest:
    """What a replica needs of a request. headers: lower-case names, hop-by-hop ones dropped; route_key:
    the prompt's chained chunk hashes (prefix_key.route_key), read by the router only."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    route_key: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResponseStart:
    """The first item a replica yields: status and headers (hop-by-hop ones dropped), and who served it."""

    status: int
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    replica_id: str = ""


def end_to_end(headers: Any) -> tuple[tuple[str, str], ...]:
    """(name, value) pairs, names lower-cased, hop-by-hop headers left out."""
    return tuple((k.lower(), v) for k, v in headers if k.lower() not in HOP_BY_HOP)


def _scope(fwd: ForwardedRequest) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": fwd.method, "scheme": "http", "path": fwd.path, "raw_path": fwd.path.encode(),
            "query_string": fwd.query, "root_path": "", "client": ("ray-ingress", 0),
            "server": ("kvpilot-replica", 80),
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fwd.headers]
            + [(b"content-length", str(len(fwd.body)).encode())], "state": {}}


async def call_asgi(app: Any, fwd: ForwardedRequest, replica_id: str = "") -> AsyncIterator[ResponseStart | bytes]:
    """Serves `fwd` with the ASGI `app`; see the module docstring. An app that fails before starting a
    response raises here; after, the stream just ends (the client sees a cut response)."""
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": fwd.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(_scope(fwd), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = end_to_end((k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"])
                yield ResponseStart(message["status"], headers, replica_id)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        gone.set()  # the caller left or the response ended: either way the app may finish now
        if not task.done():
            _RUNNING.add(task)
            task.add_done_callback(_RUNNING.discard)
