"""create_app: the FastAPI app of `kvpilot serve` (OpenAI-compatible endpoints, /health, /metrics, /version).

The app owns one EngineClient (the engine core: its own process by default, a thread with
ServerArgs.engine_process=False), one metrics registry and one admission controller; the engine is built by
the core at start-up, so /health answers 503 until the model is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import kvpilot
from kvpilot.outputs import RequestOutput
from kvpilot.server.admission import AdmissionController, QueueLimits
from kvpilot.server.config import ServerArgs
from kvpilot.server.engine_client import EngineClient, EngineDeadError, EngineQueryError
from kvpilot.server.engine_spec import EngineFactory
from kvpilot.server.errors import APIError, install_error_handlers
from kvpilot.server.messages import IntegrityQuery
from kvpilot.server.metrics import MemoryCollector, ServerMetrics
from kvpilot.server.proc_memory import ProcessMemory, read_process_memory, sum_process_memory
from kvpilot.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.server.serving import prepare, respond_stream, respond_whole
from kvpilot.server.state import ServerState
from kvpilot.server.stats_logger import TokenTotals, log_stats_forever

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_state(factory: EngineFactory, args: ServerArgs) -> ServerState:
    holder: dict[str, Any] = {}
    client = EngineClient(factory, in_process=not args.engine_process,
                          on_final=lambda o: _on_final(holder["state"], o),
                          on_progress=lambda rid: holder["state"].admission.release(rid),
                          on_step=lambda s: holder["state"].metrics.observe_step(s))
    metrics = ServerMetrics(args.model_name, lambda: client.stats,
                            memory=MemoryCollector(process=lambda: _deployment_memory(client)))
    admission = AdmissionController(QueueLimits(args.max_num_queued_reqs, args.max_num_queued_tokens))
    holder["state"] = state = ServerState(args, client, metrics, admission)
    return state


def _deployment_memory(client: EngineClient) -> ProcessMemory | None:
    """The server's and its engine core process's memory together: weights and KV live in the core."""
    core = read_process_memory(str(client.core_pid)) if client.core_pid is not None else None
    return sum_process_memory([read_process_memory(), core])


def _on_final(state: ServerState, output: RequestOutput) -> None:
    from kvpilot.engine.timeline import RequestMetrics

    if isinstance(output.metrics, RequestMetrics):
        state.metrics.observe_finished(output.metrics)


def _totals(metrics: ServerMetrics) -> TokenTotals:
    labels = {"model_name": metrics.model_name}
    read = metrics.registry.get_sample_value
    return TokenTotals(read("vllm:prompt_tokens_total", labels) or 0.0,
                       read("vllm:generation_tokens_total", labels) or 0.0)


def create_app(factory: EngineFactory, args: ServerArgs | None = None) -> FastAPI:
    """The app; `factory` builds the engine in the engine core (see engine_spec.engine_factory): its own
    process unless args.engine_process is False or the factory holds preloaded weights (then a thread).
    `app.state.kvpilot` is the ServerState (the runner's drain reads it)."""
    args = args or ServerArgs()
    state = build_state(factory, args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        logger_task = asyncio.create_task(log_stats_forever(lambda: state.client.stats,
                                                            lambda: _totals(state.metrics), args.stats_interval))
        try:
            yield
        finally:
            logger_task.cancel()
            state.tokenizer_pool.shutdown()
            await state.client.stop()

    app = FastAPI(title="kvpilot", version=kvpilot.__version__, lifespan=lifespan)
    app.state.kvpilot = state
    install_error_handlers(app)
    app.add_middleware(_ArrivalStamp)
    auth = [Depends(_api_key_check(args.api_key))]
    _add_openai_routes(app, state, auth)
    _add_ops_routes(app, state, auth)
    return app


class _ArrivalStamp:
    """Pure ASGI middleware (BaseHTTPMiddleware would wrap every stream): stamps the arrival on
    time.monotonic before the body is read, so tokenize/queue/ttft count from here."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.monotonic()
        await self.app(scope, receive, send)


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>` with the key "
                                "given to --api-key", code="invalid_api_key")
    return check


def _add_openai_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    async def generate(request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        prepared = await prepare(state, body, arrival=request.state.arrival)
        try:
            if prepared.stream:
                return respond_stream(state, prepared)
            return await respond_whole(state, prepared, request.is_disconnected)
        except BaseException:
            state.admission.release(prepared.shape.request_id)
            raise

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await generate(request, body)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await generate(request, body)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        info = state.client.info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvpilot",
             "root": info.model if info else None, "max_model_len": info.max_model_len if info else None}
            for name in state.args.served_model_names]}


def _add_ops_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.client.error is not None:
            return APIError(503, f"the engine failed: {state.client.error}", code="engine_failed").response()
        if state.draining:
            return APIError(503, "draining", code="draining").response()
        if not state.client.ready.is_set():
            return APIError(503, "loading the model", code="loading").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvpilot.__version__}

    @app.get("/v1/kvpilot/capacity", dependencies=auth)
    async def capacity() -> dict[str, Any]:
        state.check_ready()
        return state.info.capacity

    @app.get("/v1/kvpilot/integrity", dependencies=auth)
    async def integrity() -> JSONResponse:
        """Runs the scheduler's invariant checks between steps; 500 names the broken invariant."""
        state.check_ready()
        try:
            return JSONResponse(await state.client.query(IntegrityQuery))
        except EngineQueryError as exc:
            raise APIError(500, f"integrity check failed: {exc}", code="integrity") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_failed") from exc
