"""API-key check for every route but /health (and /metrics, /dashboard with --metrics-public), as pure ASGI
middleware.

Middleware rather than a route dependency so that nothing escapes it: /docs, /redoc, /openapi.json, unknown
paths and wrong methods all answer 401 to a client without the key, and the check runs before the request
body is read (an unauthenticated client cannot make the server buffer a large upload).
"""

from __future__ import annotations

import hmac
from typing import Any

from kvpilot.server.openai.errors import APIError

OPEN_PATHS = frozenset({"/health"})
# What --metrics-public opens: the metrics and the live dashboard built from them (dashboard.py), no more.
METRICS_PATHS = frozenset({"/metrics", "/dashboard", "/v1/kvpilot/dashboard"})


def open_paths(metrics_public: bool) -> frozenset[str]:
    """The paths a client may call without the key."""
    return OPEN_PATHS | (METRICS_PATHS if metrics_public else frozenset())


class ApiKeyGuard:
    """Invariant: with `api_key` None every request passes; otherwise a request passes only if its path is in
    `open_paths` or it carries `Authorization: Bearer <api_key>` (compared in constant time)."""

    def __init__(self, app: Any, api_key: str | None, metrics_public: bool = False) -> None:
        self.app = app
        self._key = api_key.encode() if api_key is not None else None
        self.open_paths = open_paths(metrics_public)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self._key is None or scope["path"] in self.open_paths \
                or _authorized(scope, self._key):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>` with the key "
                              "given to --api-key", code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


def _authorized(scope: dict[str, Any], key: bytes) -> bool:
    header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
