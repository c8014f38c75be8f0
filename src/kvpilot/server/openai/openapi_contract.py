"""The OpenAPI schema the server really honours: its error statuses, bodies and content types.

FastAPI documents a 422 `HTTPValidationError` for every route with a body, but kvpilot answers invalid
requests with 400 and the OpenAI error body (errors.py), and adds statuses FastAPI cannot know about (401
from ApiKeyGuard, 408/413 from BodyGuard, 429 from admission, 503 while loading or draining). `install`
replaces app.openapi with a builder that says so; schemathesis checks the result (tests/server/
test_reliability_schemathesis.py). The request models state their own bounds (protocol.py, chat_messages.py,
tokenize_routes.py); the one that depends on the model, a token id's, is the TokenId component defined here
from the served model's vocabulary.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvpilot.server.openai.request_fields import TOKEN_ID_SCHEMA, TOKEN_ID_TITLE

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}
HEALTH_SCHEMA: dict[str, Any] = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
# One server-sent event: `data:` carries a JSON chunk, an error, or `[DONE]` at the end.
SSE_EVENT_SCHEMA: dict[str, Any] = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_DESCRIPTIONS = {400: "Invalid request (OpenAI error body)", 401: "Missing or wrong API key",
                 404: "Unknown model", 405: "Method not allowed", 408: "The request body arrived too slowly",
                 409: "A request with this X-Request-Id is still running",
                 413: "The request body is over --max-request-body-bytes",
                 429: "Queue full (Retry-After)", 500: "Internal error", 503: "Loading, draining or engine failed"}
_GENERATE = (400, 404, 408, 409, 413, 429, 503)
_TOKENIZE = (400, 404, 408, 413, 503)
_PER_PATH: dict[str, tuple[int, ...]] = {"/v1/completions": _GENERATE, "/v1/chat/completions": _GENERATE,
                                         "/tokenize": _TOKENIZE, "/detokenize": _TOKENIZE,
                                         "/health": (503,), "/v1/kvpilot/capacity": (503,),
                                         "/v1/kvpilot/integrity": (500, 503)}


def install(app: FastAPI, open_paths: frozenset[str], auth: bool) -> None:
    """Makes app.openapi() build the schema above; `open_paths` need no API key even with `auth`. Built once
    the engine is ready (TokenId's bound is its vocabulary), afresh on each call before."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            vocab_size = _vocab_size(app)
            schema = _honest(get_openapi(title=app.title, version=app.version, routes=app.routes), open_paths,
                             auth, vocab_size)
            if vocab_size is None:
                return schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _vocab_size(app: FastAPI) -> int | None:
    """The served model's vocabulary size, None while it loads (app.state.kvpilot is the ServerState)."""
    state = getattr(app.state, "kvpilot", None)
    info = state.client.info if state is not None else None
    return info.vocab_size if info is not None else None


def _token_ids(node: Any) -> Any:
    """`node` with every TokenId schema in it (request_fields.TOKEN_ID_SCHEMA) a reference to the component."""
    if isinstance(node, dict):
        if node.get("title") == TOKEN_ID_TITLE and node.get("type") == "integer":
            return {"$ref": f"#/components/schemas/{TOKEN_ID_TITLE}"}
        return {key: _token_ids(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_token_ids(item) for item in node]
    return node


def _error(status: int) -> dict[str, Any]:
    return {"description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _honest(schema: dict[str, Any], open_paths: frozenset[str], auth: bool,
            vocab_size: int | None) -> dict[str, Any]:
    """FastAPI's schema with kvpilot's statuses, error body, content types and token id bound."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = ERROR_SCHEMA
    if auth:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            statuses = _PER_PATH.get(path, ()) + ((401,) if auth and path not in open_paths else ())
            for status in statuses:
                responses[str(status)] = _error(status)
            if auth and path not in open_paths:
                operation["security"] = [{"bearer": []}]
    _content(schema, "/health", "get", {"application/json": {"schema": HEALTH_SCHEMA}})
    _content(schema, "/metrics", "get", {"text/plain": {"schema": {"type": "string"}}})
    for path in ("/v1/completions", "/v1/chat/completions"):
        _content(schema, path, "post", {"application/json": {"schema": {"type": "object"}},
                                        "text/event-stream": {"schema": SSE_EVENT_SCHEMA}})
    schema = _token_ids(schema)
    bound = {"maximum": vocab_size - 1} if vocab_size is not None else {}
    schema["components"]["schemas"][TOKEN_ID_TITLE] = TOKEN_ID_SCHEMA | bound
    return schema


def _content(schema: dict[str, Any], path: str, method: str, content: dict[str, Any]) -> None:
    operation = schema.get("paths", {}).get(path, {}).get(method)
    if operation is not None:
        operation["responses"]["200"]["content"] = content
