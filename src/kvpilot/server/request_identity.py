"""Request identity across hops: a gateway's `X-Request-Id` becomes kvpilot's request id.

The id a client (or a gateway such as llm-d's) sends in `X-Request-Id` is kept: the engine's request id is
`cmpl-<it>` / `chatcmpl-<it>` (vLLM's shape), and so are the response body's `id`, the access log's and the
response's `kvpilot` field; the `X-Request-Id` response header echoes what came in (on every response, errors
included). So a gateway, kvpilot and `kvpilot doctor` can join their views of one request. Without the header a
random id is made, and generation responses carry it in `X-Request-Id`.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from kvpilot.server.openai.errors import APIError

HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_SAFE = re.compile(r"[A-Za-z0-9._:/@+=-]+")  # what lands in logs and Prometheus exemplars unescaped


def client_request_id(headers: Any) -> str | None:
    """The client's X-Request-Id, or None; APIError 400 when it is too long or has unsafe characters."""
    value = headers.get(HEADER)
    if value is None:
        return None
    if not _is_valid(value):
        raise APIError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} characters of letters, digits and "
                            f"._:/@+=-", param="X-Request-Id")
    return value


def _is_valid(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and _SAFE.fullmatch(value) is not None


def engine_request_id(chat: bool, client_id: str | None) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{client_id if client_id is not None else uuid.uuid4().hex}"


class EchoRequestId:
    """ASGI middleware: every response to a request that carried a valid X-Request-Id carries it back as it
    came (errors too); without one, generation responses carry the engine's request id (set by serving.py)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((v for k, v in scope.get("headers", []) if k == HEADER.encode()), None)
        if incoming is None or not _is_valid(incoming.decode("latin-1")):
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                message = {**message, "headers": [*headers, (HEADER.encode(), incoming)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
