"""create_app: the FastAPI app of `kvpilot serve` (OpenAI-compatible endpoints, /health, /metrics, /version).

The app owns one EngineClient (the engine core: its own process by default, a thread with
ServerArgs.engine_process=False), one metrics registry and one admission controller; the engine is built by
the core at start-up, so /health answers 503 until the model is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import kvpilot
from kvpilot.outputs import RequestOutput
from kvpilot.server.openai import openapi_contract
from kvpilot.server.admission import AdmissionController, QueueLimits
from kvpilot.server.guards.auth import ApiKeyGuard, open_paths
from kvpilot.server.guards.body_guard import BodyGuard
from kvpilot.server.config import ServerArgs
from kvpilot.server.observe.dashboard import add_dashboard_routes
from kvpilot.server.observe.request_timelines import add_request_timeline_routes
from kvpilot.server.core.engine_client import EngineClient, EngineDeadError, EngineQueryError
from kvpilot.server.core.engine_spec import EngineFactory
from kvpilot.server.openai.errors import APIError, install_error_handlers
from kvpilot.server.core.messages import IntegrityQuery
from kvpilot.server.observe.metrics import MemoryCollector, ServerMetrics
from kvpilot.server.observe.proc_memory import ProcessMemory, read_process_memory, sum_process_memory
from kvpilot.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.server.request_identity import EchoRequestId, client_request_id
from kvpilot.server.serving import ClientDisconnected, prepare, respond_stream, respond_whole
from kvpilot.server.state import ServerState
from kvpilot.server.observe.stats_logger import TokenTotals, log_stats_forever
from kvpilot.server.openai.tokenize_routes import add_tokenize_routes
from kvpilot.server.observe.tracing import TraceParentCapture, build_tracer

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_CLOSED_REQUEST = 499


def build_state(factory: EngineFactory, args: ServerArgs) -> ServerState:
    # First: a bad --otlp-traces-endpoint or a missing OpenTelemetry package fails before anything starts.
    tracer = build_tracer(args.otlp_traces_endpoint, kvpilot.__version__)
    holder: dict[str, Any] = {}
    client = EngineClient(factory, in_process=not args.engine_process,
                          on_final=lambda o: _on_final(holder["state"], o),
                          on_progress=lambda rid: holder["state"].admission.release(rid),
                          on_step=lambda s: holder["state"].metrics.observe_step(s),
                          on_ready=lambda: holder["state"].on_engine_ready())
    metrics = ServerMetrics(args.model_name, lambda: client.stats,
                            memory=MemoryCollector(process=lambda: _deployment_memory(client)),
                            info=lambda: client.info)
    admission = AdmissionController(QueueLimits(args.max_num_queued_reqs, args.max_num_queued_tokens))
    holder["state"] = state = ServerState(args, client, metrics, admission, tracer=tracer)
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
            await asyncio.to_thread(state.tracer.shutdown)  # flushes the last spans (may wait on the collector)

    app = FastAPI(title="kvpilot", version=kvpilot.__version__, lifespan=lifespan)
    app.state.kvpilot = state
    install_error_handlers(app)
    # The last added runs first: stamp the arrival, then check the key, then read the body within its limits.
    app.add_middleware(BodyGuard, max_bytes=args.max_request_body_bytes, timeout_s=args.body_timeout_s)
    app.add_middleware(ApiKeyGuard, api_key=args.api_key, metrics_public=args.metrics_public)
    if state.tracer.enabled:
        app.add_middleware(TraceParentCapture)  # the client's traceparent, for the request's spans
    app.add_middleware(_ArrivalStamp)
    app.add_middleware(EchoRequestId)  # outermost: a 401 or 413 echoes the client's X-Request-Id too
    _add_openai_routes(app, state)
    add_tokenize_routes(app, state)
    _add_ops_routes(app, state)
    add_dashboard_routes(app, state.metrics)
    add_request_timeline_routes(app, state)  # GET /v1/kvpilot/requests/{id}: `kvpilot doctor --request`
    openapi_contract.install(app, open_paths(args.metrics_public), auth=args.api_key is not None)
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


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    async def generate(request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        prepared = await prepare(state, body, arrival=request.state.arrival,
                                 client_id=client_request_id(request.headers))
        try:
            if prepared.stream:
                return respond_stream(state, prepared)
            return await respond_whole(state, prepared, _disconnected(request))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; nginx's code, for logs
        except BaseException:
            for rid in prepared.request_ids:
                state.admission.release(rid)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await generate(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        if state.client.ready.is_set():  # tool_choice "auto": the flags', else the chat template's parser
            body.allow_auto_tool_choice(state.auto_tool_choice().parser)
        return await generate(request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = state.client.info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvpilot",
             "root": info.model if info else None, "max_model_len": info.max_model_len if info else None}
            for name in state.args.served_model_names]}


def _disconnected(request: Request) -> Callable[[], Awaitable[None]]:
    """Returns when the client has gone. Only for use after the body was read: then the server's `receive`
    has nothing but `http.disconnect` left to give."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def _add_ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 `{"status": "ok"}` when the model is loaded and requests are admitted; 503 otherwise (also while
        the channel to the engine core has not moved for its watchdog's limit: core/pipe_channel.py)."""
        if state.client.error is not None:
            return APIError(503, f"the engine failed: {state.client.error}", code="engine_failed").response()
        if state.draining:
            return APIError(503, "draining", code="draining").response()
        if not state.client.ready.is_set():
            return APIError(503, "loading the model", code="loading").response()
        if (stall := state.client.channel_stall) is not None:
            return APIError(503, stall, code="engine_channel_stalled").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvpilot.__version__}

    @app.get("/v1/kvpilot/capacity")
    async def capacity() -> dict[str, Any]:
        state.check_ready()
        return state.info.capacity

    @app.get("/v1/kvpilot/integrity")
    async def integrity() -> JSONResponse:
        """Runs the scheduler's invariant checks between steps; 500 names the broken invariant."""
        state.check_ready()
        try:
            return JSONResponse(await state.client.query(IntegrityQuery))
        except EngineQueryError as exc:
            raise APIError(500, f"integrity check failed: {exc}", code="integrity") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_failed") from exc
