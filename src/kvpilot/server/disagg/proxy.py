"""`kvpilot proxy`: a standalone router in front of kvpilot workers (issue #49 item 2).

Two modes:
- disaggregated (`--prefill URL ... --decode URL ...`): each completion/chat request is prefilled on a prefill
  worker and generated on a decode worker (handoff.py), the decode worker's answer streamed to the client;
- mixed (`--worker URL ...`): each request goes whole to one worker (fewest in flight): the like-for-like
  baseline of benchmarks/disaggregation.py, and a plain least-loaded balancer.
Every other path (/v1/models, /tokenize, ...) goes to a decode (or mixed) worker. /health is 200 when every
worker answers its own /health with 200. The client's Authorization header is passed to the workers.

Invariants: the client sees the decode worker's status, headers and body as they come, plus
`x-kvpilot-prefill-worker` / `x-kvpilot-decode-worker`; a prefill worker's error (status >= 400) is returned
as it is and nothing is sent to a decode worker; a failure before the decode worker answered is an OpenAI
error (502/503); a client that leaves mid-stream closes the decode worker's response (which aborts the
request there). The proxy never loads torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpilot.server.disagg.handoff import (DEFAULT_MAX_LOCAL_PREFILL_TOKENS, GENERATE_PATHS, HandoffError,
                                           WorkerPool, decode_body, parse_request, prefill_answer, prefill_body,
                                           prefills_locally)
from kvpilot.server.openai.errors import APIError, install_error_handlers

logger = logging.getLogger("kvpilot.proxy")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade", "te",
                         "trailer", "host", "content-encoding"})
_FORWARDED_HEADERS = ("authorization", "x-request-id", "x-lane", "x-priority")


@dataclass(frozen=True)
class ProxyConfig:
    """Worker URLs (no trailing /v1). Invariant: either prefill_urls and decode_urls are both non-empty
    (disaggregated) or worker_urls is (mixed), never both; timeout_s bounds connecting and each read."""

    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    worker_urls: tuple[str, ...] = ()
    timeout_s: float = 600.0
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS

    def check(self) -> None:
        disaggregated = bool(self.prefill_urls) or bool(self.decode_urls)
        if disaggregated and self.worker_urls:
            raise ValueError("give either --prefill and --decode workers (disaggregated) or --worker ones "
                             "(mixed), not both")
        if disaggregated and not (self.prefill_urls and self.decode_urls):
            raise ValueError("disaggregated serving needs at least one --prefill and one --decode worker")
        if self.max_local_prefill_tokens < 0:
            raise ValueError(f"--max-local-prefill-tokens must be >= 0, got {self.max_local_prefill_tokens}")
        if not disaggregated and not self.worker_urls:
            raise ValueError("give the workers: --prefill URL --decode URL (disaggregated) or --worker URL "
                             "(mixed)")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_urls)


class _Router:
    """The proxy's state: the worker pools and one HTTP client session (opened in the app's lifespan)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = WorkerPool(config.prefill_urls) if config.disaggregated else None
        self.decode = WorkerPool(config.decode_urls if config.disaggregated else config.worker_urls)
        self.session: aiohttp.ClientSession | None = None
        self.num_handoffs = 0
        self.num_local_prefills = 0  # prompts short enough to prefill on their decode worker
        self.prefill_seconds = 0.0

    def open(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.timeout_s,
                                        sock_read=self.config.timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def prefill_params(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], str]:
        """Runs the prefill hop; its kv_transfer_params and the worker's URL. A worker error: HandoffError
        carrying the worker's own status and message."""
        assert self.prefill is not None and self.session is not None
        url = self.prefill.pick()
        started = time.perf_counter()
        try:
            async with self.session.post(url + _path(body), json=prefill_body(body), headers=headers) as resp:
                return prefill_answer(resp.status, await resp.read()), url
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise HandoffError(503, f"the prefill worker {url} did not answer ({type(exc).__name__}: {exc}); "
                                    "retry shortly", "worker_unavailable") from exc
        finally:
            self.prefill.done(url)
            self.prefill_seconds += time.perf_counter() - started


def _path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}


async def _relay(resp: aiohttp.ClientResponse, pool: WorkerPool, url: str) -> AsyncIterator[bytes]:
    """The worker's body as it comes; closing early (the client left) closes the worker's response."""
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    finally:
        if resp.content.at_eof():
            resp.release()  # the connection goes back to the pool, kept alive
        else:
            resp.close()  # the client left mid-body: the worker sees the disconnect and aborts the request
        pool.done(url)


def create_proxy_app(config: ProxyConfig) -> FastAPI:
    """The proxy's ASGI app (run by `kvpilot proxy`, or by a test in process)."""
    config.check()
    router = _Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        router.open()
        yield
        assert router.session is not None
        await router.session.close()

    app = FastAPI(title="kvpilot proxy", lifespan=lifespan)
    install_error_handlers(app)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        for url in (*config.prefill_urls, *router.decode.urls):
            status = await _status(router, url + "/health")
            if status != 200:
                return APIError(503, f"worker {url} is not ready ({status or 'no answer'})",
                                code="worker_unavailable").response()
        return JSONResponse({"status": "ok", "disaggregated": config.disaggregated})

    @app.get("/v1/kvpilot/proxy")
    async def proxy_stats() -> dict[str, Any]:
        return {"disaggregated": config.disaggregated, "num_handoffs": router.num_handoffs,
                "num_local_prefills": router.num_local_prefills,
                "max_local_prefill_tokens": config.max_local_prefill_tokens,
                "prefill_seconds": round(router.prefill_seconds, 6),
                "in_flight": {**(router.prefill.in_flight if router.prefill else {}), **router.decode.in_flight}}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(request: Request, path: str) -> Response:
        raw = await request.body()
        headers = _forwarded_headers(request)
        extra: dict[str, str] = {}
        if config.disaggregated and request.method == "POST" and request.url.path in GENERATE_PATHS:
            try:
                body = parse_request(raw)
                if not prefills_locally(body, config.max_local_prefill_tokens):
                    params, prefill_url = await router.prefill_params(body, headers)
                    raw = json.dumps(decode_body(body, params)).encode()
                    router.num_handoffs += 1
                    extra["x-kvpilot-prefill-worker"] = prefill_url
                else:
                    router.num_local_prefills += 1
            except HandoffError as exc:
                return APIError(exc.status, exc.message, code=exc.code).response()
        return await _send(router, request, raw, {**headers, "content-type": "application/json"}, extra)

    return app


async def _status(router: _Router, url: str) -> int | None:
    assert router.session is not None
    try:
        async with router.session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def _send(router: _Router, request: Request, raw: bytes, headers: dict[str, str],
                extra: dict[str, str]) -> Response:
    """Sends the request to a decode (or mixed) worker and streams its answer back."""
    assert router.session is not None
    url = router.decode.pick()
    target = url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    try:
        resp = await router.session.request(request.method, target, data=raw, headers=headers)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        router.decode.done(url)
        return APIError(503, f"the worker {url} did not answer ({type(exc).__name__}: {exc}); retry shortly",
                        code="worker_unavailable").response()
    out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
    out_headers.update(extra)
    out_headers["x-kvpilot-decode-worker"] = url
    return StreamingResponse(_relay(resp, router.decode, url), status_code=resp.status, headers=out_headers)
