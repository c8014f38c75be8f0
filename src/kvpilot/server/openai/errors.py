"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}, with the HTTP status.

Every error a client can cause is an `APIError`; FastAPI's validation errors and engine errors are
mapped here so that no handler returns anything else. As in vLLM, `code` is always the HTTP status (an
integer), and `type` says what kind of error it is: the specific reason where there is one
(`context_length_exceeded`, `engine_failed`, ...), else the status's OpenAI category.
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
    """An error sent to the client as OpenAI JSON. `code`: the machine-readable reason, sent as the body's
    `type` (the body's `code` is the status); `headers` carries e.g. Retry-After for 429."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = self.code if self.code is not None else _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": _utf8(self.message), "type": kind, "param": _utf8(self.param),
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_data(self) -> str:
        """The error as one SSE event (after a stream has started, the status line is already sent)."""
        return f"data: {json.dumps(self.body())}\n\n"


def _utf8(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a lone surrogate the client sent (echoed in a message) is escaped, so
    rendering the error can never fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if text is not None else None


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


class RequestFailedError(ValueError):
    """The engine failed this request alone (a step that ran it by itself raised; engine/step_failures.py)
    and kept serving the others. Sent to its client as a 500 with the message (an SSE error event once a
    stream has started). A ValueError, like the engine's refusals of a request, so that the one path that
    turns a request's engine-side error into an APIError (from_value_error) carries it."""


def from_value_error(exc: ValueError) -> APIError:
    """Engine/sampling ValueErrors carry their field in the message (`SamplingParams.top_p must ...`); a
    RequestFailedError is the server's fault, not the client's: 500."""
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"the engine failed this request: {exc}", code="request_failed")
    message = str(exc)
    match = _PARAM_IN_MESSAGE.search(message)
    return APIError(400, message.replace("SamplingParams.", ""), param=match.group(1) if match else None)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}; "
                             "send a JSON object", code="invalid_json")
    param = _param(first.get("loc", ()))
    if _is_union(first):  # a value that fits none of a field's accepted shapes: name the field, list them
        field = _union_path(first)
        same_field = [e for e in errors if _is_union(e) and _union_path(e) == field]
        param, message = field, f"{field}: {_union_message(same_field)}"
        others = len(errors) - len(same_field)
    else:
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        others = len(errors) - 1
    if others:
        message += f" (and {others} more error{'s' if others > 1 else ''})"
    return APIError(400, message, param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: object) -> bool:
    """pydantic names the member of a union an error is about by its type: `str`, `list[int]`, ..."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def _param(loc: tuple | list) -> str | None:
    """The field path of an error location, without `body` and union member tags (`prompt.list[int].0` ->
    `prompt.0`)."""
    return ".".join(str(p) for p in loc if p != "body" and not _is_type_tag(p)) or None


def _union_path(error: dict) -> str | None:
    """The path of the field whose union the error is about (its location up to the first member tag)."""
    parts: list[str] = []
    for part in error.get("loc", ()):
        if _is_type_tag(part):
            break
        if part != "body":
            parts.append(str(part))
    return ".".join(parts) or None


def _is_union(error: dict) -> bool:
    return any(_is_type_tag(p) for p in error.get("loc", ()))


def _union_message(errors: list[dict]) -> str:
    shapes = sorted({next((str(p) for p in e["loc"] if _is_type_tag(p)), "?") for e in errors})
    return f"the value fits none of the accepted types ({', '.join(shapes)})"


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
        """Starlette's 404/405 in the OpenAI format, keeping their headers (405's `Allow`)."""
        return APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")  # the details go to the log, not to the client
        return APIError(500, f"internal server error ({type(exc).__name__}): the server log has the details; "
                             "please report it").response()
