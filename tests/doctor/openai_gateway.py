"""An OpenAI-only gateway in front of a kvpilot server, for the doctor's live scenarios (tests only).

Many production deployments put a gateway in front of the engine that exposes the OpenAI API and
nothing else. This one forwards ``/v1/*`` (SSE streams included) and hides what is kvpilot's own: the
top-level ``"kvpilot"`` field of every JSON body and every SSE ``data:`` chunk (per-request queue,
tokenize, prefill and decode timings), the ``Server-Timing`` header, and ``/metrics`` (404, like every
path outside ``/v1/``). Everything else passes unchanged: status, OpenAI fields, ``usage``, and the
timing of the stream, since each complete SSE line is forwarded as soon as it arrives. The engine and
its scheduling are untouched: the gateway only removes what a client behind it could have seen.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpilot.server.background import free_port

HIDDEN_FIELD = "kvpilot"
# Server-Timing carries kvpilot's stages; the others describe the upstream hop (its framing, date and
# server name), which the gateway's own HTTP server sets again for the (possibly rewritten) body.
DROPPED_RESPONSE_HEADERS = frozenset({"server-timing", "content-length", "content-encoding",
                                      "transfer-encoding", "connection", "keep-alive", "date", "server"})
DROPPED_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive",
                                     "transfer-encoding"})


def strip_json(body: bytes) -> bytes:
    """``body`` without the top-level ``"kvpilot"`` field. Returns ``body`` itself (the same object)
    when there is nothing to remove: not JSON (``[DONE]``, errors in text), not an object, no field."""
    try:
        obj = json.loads(body)
    except ValueError:  # UnicodeDecodeError is one too
        return body
    if not isinstance(obj, dict) or HIDDEN_FIELD not in obj:
        return body
    del obj[HIDDEN_FIELD]
    return json.dumps(obj).encode()


def strip_sse_line(line: bytes) -> bytes:
    """One event-stream line, its ending (``\\n`` or ``\\r\\n``) kept: a ``data:`` line's JSON loses
    the field; every other line (blank separators, comments, other fields) is returned unchanged."""
    if not line.startswith(b"data:"):
        return line
    payload = line[5:].rstrip(b"\r\n")
    stripped = strip_json(payload)
    return line if stripped is payload else b"data: " + stripped + line[5 + len(payload):]


async def strip_sse(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Re-chunk a stream into complete lines, each through :func:`strip_sse_line`. A line is yielded
    as soon as its newline arrives (so token timing survives); a partial line waits for its end."""
    pending = b""
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        if lines:
            yield b"".join(strip_sse_line(line + b"\n") for line in lines)
    if pending:
        yield strip_sse_line(pending)


def _upstream_request(http: httpx.AsyncClient, request: Request, body: bytes) -> httpx.Request:
    query = request.url.query
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_REQUEST_HEADERS}
    return http.build_request(request.method, request.url.path + (f"?{query}" if query else ""),
                              headers=headers, content=body)


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The stripped stream; the upstream response is closed even when the client leaves mid-stream
    (a cancelled generator still runs ``finally``), so kvpilot sees the disconnect and aborts."""
    try:
        async for out in strip_sse(upstream.aiter_bytes()):
            yield out
    finally:
        await upstream.aclose()


def gateway_app(upstream_url: str) -> FastAPI:
    """The gateway as an ASGI app: one catch-all route; one pooled HTTP client to ``upstream_url``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # No read timeout: the client behind the gateway owns that decision (the bench has its own).
        async with httpx.AsyncClient(base_url=upstream_url, timeout=httpx.Timeout(None, connect=10.0)) as http:
            app.state.http = http
            yield

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(request: Request) -> Response:
        if not request.url.path.startswith("/v1/"):  # /metrics, /health, ...: the OpenAI API only
            return JSONResponse({"error": {"message": "Not Found", "type": "not_found"}}, status_code=404)
        http: httpx.AsyncClient = request.app.state.http
        upstream = await http.send(_upstream_request(http, request, await request.body()), stream=True)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay(upstream), status_code=upstream.status_code, headers=headers)
        try:
            body = await upstream.aread()
        finally:
            await upstream.aclose()
        return Response(strip_json(body), status_code=upstream.status_code, headers=headers)

    return app


@dataclass(frozen=True)
class Gateway:
    """A running gateway: ``url`` is its base URL."""

    url: str


@contextlib.contextmanager
def openai_gateway(upstream_url: str) -> Iterator[Gateway]:
    """The gateway listening on 127.0.0.1 (a free port) in a daemon thread. It is not a kvpilot server,
    so it runs under plain uvicorn (kvpilot's BackgroundServer reads the kvpilot app's server args)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gateway_app(upstream_url), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="openai-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield Gateway(f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(10)
