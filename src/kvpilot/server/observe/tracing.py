"""OpenTelemetry traces of finished requests (`kvpilot serve --otlp-traces-endpoint URL`, vLLM's flag).

One SERVER span `llm_request` per finished generation request, with vLLM's `gen_ai.*` attributes, and one
child span per stage of the request's timings (timings.py): tokenize, queue, prefill, decode, serialize. The
spans are built after the request finished, from its RequestTimings, with explicit start and end times, so
tracing adds nothing to a request's path but a few microseconds at its end; the BatchSpanProcessor exports
them from its own thread (OTLP over HTTP/protobuf).

Invariants of the spans of one request: the children tile the parent in the order above, back to back, each
as long as its `*_ms` timing field (to the nanosecond, but clamped inside the parent, which lasts `e2e_ms`);
the parent is the W3C `traceparent` of the incoming request when it sent a valid one (TraceParentCapture),
else the request starts a new trace. The body's reading and parsing count as queue in the timings, so the
tokenize span is drawn from the arrival: the stages' lengths are exact, their order in time is the split's.

The OpenTelemetry SDK and exporter are the optional extra `kvpilot[otel]`, imported only when tracing is
on: this module itself imports nothing but the standard library at load time (the HTTP process stays light
and torch-free either way).
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from kvpilot.server.config import ServerConfigError

if TYPE_CHECKING:
    from kvpilot.engine.timeline import RequestMetrics
    from kvpilot.server.prepared import Prepared
    from kvpilot.server.observe.timings import RequestTimings

logger = logging.getLogger("kvpilot.server.observe.tracing")
INSTALL_HINT = "pip install 'kvpilot[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
# (module, what it gives): checked at start-up, so a missing package fails there and not at the first request.
_REQUIRED_MODULES = (("opentelemetry.sdk.trace", "the OpenTelemetry SDK"),
                     ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "the OTLP/HTTP span exporter"))
OTLP_TRACES_PATH = "/v1/traces"
ROOT_SPAN_NAME = "llm_request"  # vLLM's
SPAN_STAGES: tuple[str, ...] = ("tokenize", "queue", "prefill", "decode", "serialize")

# The incoming request's trace headers (traceparent, tracestate), set by TraceParentCapture for the whole
# request, including the tasks that stream its body: they copy the context they were created in.
_TRACE_HEADERS: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("kvpilot_trace_headers", default={})


class TracingUnavailableError(ServerConfigError):
    """--otlp-traces-endpoint was given but the OpenTelemetry packages are not installed."""


def otlp_traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: `endpoint` as given, or with /v1/traces appended when it names no path
    (`http://collector:4318`: no collector takes traces at `/`). Raises ServerConfigError for anything but an
    http(s) URL with a host (OTLP/gRPC is not supported: use the collector's OTLP/HTTP port, 4318)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ServerConfigError(f"--otlp-traces-endpoint must be an http:// or https:// URL of an OTLP/HTTP "
                                f"collector, e.g. http://localhost:4318/v1/traces, got {endpoint!r} (kvpilot "
                                f"exports OTLP over HTTP/protobuf, not gRPC: use the collector's port 4318)")
    if parts.path in ("", "/"):
        parts = parts._replace(path=OTLP_TRACES_PATH)
    return urlunsplit(parts)


def check_tracing_available() -> None:
    """Raises TracingUnavailableError naming what to install when the OpenTelemetry SDK or exporter is
    missing."""
    import importlib

    for module, what in _REQUIRED_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TracingUnavailableError(f"--otlp-traces-endpoint needs {what} ({module} did not import: "
                                          f"{exc}): {INSTALL_HINT}") from exc


@dataclass(frozen=True)
class StageSpan:
    """One stage's span: name and [start_ns, end_ns] on the Unix epoch, start_ns <= end_ns."""

    name: str
    start_ns: int
    end_ns: int


def stage_spans(start_ns: int, timings: RequestTimings) -> tuple[int, list[StageSpan]]:
    """The parent's end and the stages' spans for a request that arrived at `start_ns` (module invariants)."""
    end_ns = start_ns + _ns(timings.e2e_ms)
    spans, cursor = [], start_ns
    for stage in SPAN_STAGES:
        stop = min(cursor + _ns(getattr(timings, f"{stage}_ms")), end_ns)
        spans.append(StageSpan(stage, cursor, stop))
        cursor = stop
    return end_ns, spans


def _ns(ms: float) -> int:
    return round(ms * 1_000_000)


class NullTracer:
    """Tracing off: records nothing."""

    enabled = False

    def record(self, prepared: Prepared, status: int, timings: RequestTimings,
               metrics: RequestMetrics | None) -> None:
        pass

    def force_flush(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class RequestTracer(NullTracer):
    """Exports the spans of each finished request to an OTLP/HTTP collector (module docstring)."""

    enabled = True

    def __init__(self, endpoint: str, service_version: str, exporter: Any = None) -> None:
        """`exporter`: a SpanExporter to use instead of OTLP/HTTP to `endpoint` (tests)."""
        check_tracing_available()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.url = otlp_traces_url(endpoint)
        # Resource.create also reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (they win).
        resource = Resource.create({"service.name": "kvpilot", "service.version": service_version})
        self._provider = TracerProvider(resource=resource)  # never the global one: one per app
        self._provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=self.url)))
        self._tracer = self._provider.get_tracer("kvpilot.server", service_version)
        self._propagator = TraceContextTextMapPropagator()

    def record(self, prepared: Prepared, status: int, timings: RequestTimings,
               metrics: RequestMetrics | None) -> None:
        """Once per finished request, on the event loop. Never raises: a tracing fault is logged, the
        request it describes has been answered already."""
        try:
            self._record(prepared, status, timings, metrics)
        except Exception:  # noqa: BLE001 - observability must not fail the request path
            logger.exception("could not record the trace of %s", prepared.shape.request_id)

    def _record(self, prepared: Prepared, status: int, timings: RequestTimings,
                metrics: RequestMetrics | None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        # The request's arrival on the epoch clock: its monotonic stamp moved by the clocks' current offset.
        start_ns = round(prepared.message.arrival_time * 1e9) + time.time_ns() - time.monotonic_ns()
        end_ns, stages = stage_spans(start_ns, timings)
        parent = self._propagator.extract(carrier=_TRACE_HEADERS.get())
        root = self._tracer.start_span(ROOT_SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                       start_time=start_ns,
                                       attributes=request_attributes(prepared, status, timings, metrics))
        inside = trace.set_span_in_context(root)
        for stage in stages:
            span = self._tracer.start_span(stage.name, context=inside, start_time=stage.start_ns,
                                           attributes={"kvpilot.stage": stage.name})
            span.end(end_time=stage.end_ns)
        root.end(end_time=end_ns)

    def force_flush(self) -> bool:
        """Exports every span recorded so far; True when the exporter took them."""
        return self._provider.force_flush()

    def shutdown(self) -> None:
        """Flushes and stops the exporter's thread (at most its export timeout when the collector is gone)."""
        self._provider.shutdown()


def request_attributes(prepared: Prepared, status: int, timings: RequestTimings,
                       metrics: RequestMetrics | None) -> dict[str, Any]:
    """vLLM's span attributes (vllm/tracing.py SpanAttributes), seconds for latencies, plus the current
    semantic conventions' names for the token counts and kvpilot's own."""
    params = prepared.message.params
    prompt_tokens = len(prepared.message.prompt_token_ids)
    completion_tokens = metrics.num_generated_tokens if metrics else 0
    attributes: dict[str, Any] = {
        "gen_ai.system": "kvpilot",
        "gen_ai.operation.name": "chat" if prepared.shape.chat else "text_completion",
        "gen_ai.request.id": prepared.shape.request_id,
        "gen_ai.request.model": prepared.shape.model,
        "gen_ai.response.model": prepared.shape.model,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.top_k": params.top_k,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.n": 1,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": completion_tokens,
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": completion_tokens,
        "gen_ai.latency.time_in_queue": timings.queue_ms / 1000.0,
        "gen_ai.latency.time_to_first_token": timings.ttft_ms / 1000.0,
        "gen_ai.latency.e2e": timings.e2e_ms / 1000.0,
        "gen_ai.latency.time_in_model_prefill": timings.prefill_ms / 1000.0,
        "gen_ai.latency.time_in_model_decode": timings.decode_ms / 1000.0,
        "gen_ai.latency.time_in_model_inference": (timings.prefill_ms + timings.decode_ms) / 1000.0,
        "http.route": prepared.endpoint,
        "http.response.status_code": status,
        "kvpilot.stream": prepared.stream,
        "kvpilot.cached_tokens": metrics.num_cached_tokens if metrics else 0,
        "kvpilot.tier_cached_tokens": metrics.num_tier_cached_tokens if metrics else 0,
        "kvpilot.num_preemptions": metrics.num_preemptions if metrics else 0,
        "kvpilot.tokenize_ms": timings.tokenize_ms,
        "kvpilot.serialize_ms": timings.serialize_ms,
    }
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if metrics is not None and metrics.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = (metrics.finish_reason,)
    return attributes


class TraceParentCapture:
    """Pure ASGI middleware (installed only with tracing on): keeps the request's `traceparent` and
    `tracestate` headers in a context variable for as long as the request is handled, where
    RequestTracer.record reads them."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
                   if name in (b"traceparent", b"tracestate")}
        token = _TRACE_HEADERS.set(headers)
        try:
            await self.app(scope, receive, send)
        finally:
            _TRACE_HEADERS.reset(token)


def build_tracer(endpoint: str | None, service_version: str) -> NullTracer:
    """RequestTracer for an endpoint, NullTracer without one; raises TracingUnavailableError (packages
    missing) or ServerConfigError (not an http(s) URL)."""
    return RequestTracer(endpoint, service_version) if endpoint else NullTracer()
