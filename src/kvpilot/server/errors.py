"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}, with the HTTP status.

Every error a client can cause is an `APIError`; FastAPI's validation errors and engine errors are
mapped here so that no handler returns anything else.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvpilot.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_exceeded", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error sent to the client as OpenAI JSON. `headers` carries e.g. Retry-After for 429."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_data(self) -> str:
        """The error as one SSE event (after a stream has started, the status line is already sent)."""
        return f"data: {json.dumps(self.body())}\n\n"


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


def from_value_error(exc: ValueError) -> APIError:
    """Engine/sampling ValueErrors carry their field in the message (`SamplingParams.top_p must ...`)."""
    message = str(exc)
    match = _PARAM_IN_MESSAGE.search(message)
    return APIError(400, message.replace("SamplingParams.", ""), param=match.group(1) if match else None)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}; "
                             "send a JSON object", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server in the OpenAI format."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()
