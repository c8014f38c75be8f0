"""OpenTelemetry traces (`--otlp-traces-endpoint`): real requests through the real server and engine, their
spans exported over OTLP/HTTP to a loopback collector that decodes them with opentelemetry-proto."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvpilot.server.background import BackgroundServer
from kvpilot.server.config import ServerArgs, ServerConfigError
from kvpilot.server.observe.tracing import SPAN_STAGES, TracingUnavailableError, otlp_traces_url
from tests.server.otlp_collector import TRACES_PATH, Collector, ReceivedSpan, otlp_collector
from tests.server.tiny_server import MODEL, tiny_server, write_tiny_config



def _has_otel() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.sdk.trace") is not None
    except ModuleNotFoundError:
        return False


needs_otel = pytest.mark.skipif(not _has_otel(), reason="needs the otel extra: pip install -e '.[otel]'")

SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind
TRACE_A, PARENT_A = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACE_B, PARENT_B = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BackgroundServer, Collector]]:
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with otlp_collector() as collector, tiny_server(config, otlp_traces_endpoint=collector.url) as server:
        yield server, collector


def _stream_final(response: httpx.Response) -> dict:
    """The last SSE chunk carrying the kvpilot field (with include_usage it also has the usage)."""
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return next(c for c in reversed(chunks) if "kvpilot" in c)


def _requests(server: BackgroundServer) -> dict[str, dict]:
    """Three requests: non-streaming with a traceparent, streaming chat with another, one without."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        whole = http.post("/v1/completions", headers={"X-Request-Id": "trace-whole",
                                                      "traceparent": f"00-{TRACE_A}-{PARENT_A}-01"},
                          json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
                                "temperature": 0.7, "top_p": 0.9, "seed": 3, "ignore_eos": True})
        stream = http.post("/v1/chat/completions", headers={"X-Request-Id": "trace-stream",
                                                            "traceparent": f"00-{TRACE_B}-{PARENT_B}-01"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                 "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
        alone = http.post("/v1/completions", headers={"X-Request-Id": "trace-root"},
                          json={"model": MODEL, "prompt": "One, two,", "max_tokens": 3, "temperature": 0})
    for response in (whole, stream, alone):
        assert response.status_code == 200, response.text
    return {"cmpl-trace-whole": whole.json(), "chatcmpl-trace-stream": _stream_final(stream),
            "cmpl-trace-root": alone.json()}


@pytest.fixture(scope="module")
def exported(traced: tuple[BackgroundServer, Collector]) -> tuple[dict[str, dict], list[ReceivedSpan], Collector]:
    server, collector = traced
    started_ns = time.time_ns()
    bodies = _requests(server)
    finished_ns = time.time_ns()
    assert server.state.tracer.force_flush()
    spans = collector.wait_for(3 * (1 + len(SPAN_STAGES)))
    roots = [s for s in spans if s.name == "llm_request"]
    assert len(roots) == 3
    # Each request's span lies within the test's own wall-clock window (an ordering, not a duration).
    assert all(started_ns <= r.start_ns <= r.end_ns <= finished_ns for r in roots)
    return bodies, spans, collector


def _root(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan:
    [root] = [s for s in spans if s.name == "llm_request" and s.attributes["gen_ai.request.id"] == request_id]
    return root


@needs_otel
def test_the_exporter_posts_protobuf_to_v1_traces(exported) -> None:
    _, spans, collector = exported
    assert set(collector.paths) == {TRACES_PATH}  # the endpoint had no path: /v1/traces was appended
    assert {s.resource["service.name"] for s in spans} == {"kvpilot"}


@needs_otel
def test_the_client_traceparent_becomes_the_parent(exported) -> None:
    _, spans, _ = exported
    whole, stream = _root(spans, "cmpl-trace-whole"), _root(spans, "chatcmpl-trace-stream")
    assert (whole.trace_id, whole.parent_span_id) == (TRACE_A, PARENT_A)
    assert (stream.trace_id, stream.parent_span_id) == (TRACE_B, PARENT_B)  # streamed: the body's own task
    alone = _root(spans, "cmpl-trace-root")
    assert alone.parent_span_id == "" and alone.trace_id not in (TRACE_A, TRACE_B)
    assert {whole.kind, stream.kind, alone.kind} == {SPAN_KIND_SERVER}


@needs_otel
def test_gen_ai_attributes_match_the_request_and_its_usage(exported) -> None:
    bodies, spans, _ = exported
    for request_id, body in bodies.items():
        attributes = _root(spans, request_id).attributes
        assert body["kvpilot"]["request_id"] == request_id
        assert attributes["gen_ai.response.model"] == MODEL == attributes["gen_ai.request.model"]
        assert attributes["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
        assert attributes["gen_ai.usage.completion_tokens"] == body["usage"]["completion_tokens"]
        assert attributes["gen_ai.latency.e2e"] == pytest.approx(body["kvpilot"]["timings"]["e2e_ms"] / 1000)
        assert attributes["http.response.status_code"] == 200
    whole = _root(spans, "cmpl-trace-whole").attributes
    assert (whole["gen_ai.request.temperature"], whole["gen_ai.request.top_p"]) == (0.7, 0.9)
    assert (whole["gen_ai.request.max_tokens"], whole["gen_ai.request.seed"]) == (5, 3)
    assert whole["gen_ai.response.finish_reasons"] == ("length",)
    assert whole["gen_ai.operation.name"] == "text_completion"
    assert _root(spans, "chatcmpl-trace-stream").attributes["kvpilot.stream"] is True


@needs_otel
def test_stage_spans_tile_the_request_with_the_response_timings(exported) -> None:
    bodies, spans, _ = exported
    for request_id, body in bodies.items():
        root, timings = _root(spans, request_id), body["kvpilot"]["timings"]
        assert (root.end_ns - root.start_ns) / 1e6 == pytest.approx(timings["e2e_ms"], abs=1e-6)
        children = sorted((s for s in spans if s.parent_span_id == root.span_id), key=lambda s: s.start_ns)
        assert [c.name for c in children] == list(SPAN_STAGES)  # tokenize, queue, prefill, decode, serialize
        assert all(c.trace_id == root.trace_id for c in children)
        assert children[0].start_ns == root.start_ns
        for before, after in zip(children, children[1:]):
            assert before.end_ns == after.start_ns  # back to back, in order
        assert children[-1].end_ns <= root.end_ns
        for child in children:
            # Each as long as its timing field; the last may be clamped into the parent by rounding (< 5 us).
            assert (child.end_ns - child.start_ns) / 1e6 == pytest.approx(timings[f"{child.name}_ms"], abs=0.005)
        assert timings["prefill_ms"] > 0 and timings["decode_ms"] > 0  # real stages, not zeros


def test_an_endpoint_that_is_not_http_is_refused_with_what_to_use() -> None:
    with pytest.raises(ServerConfigError, match="port 4318"):
        otlp_traces_url("grpc://localhost:4317")
    assert otlp_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp_traces_url("https://c/custom/path") == "https://c/custom/path"


def test_without_the_otel_packages_the_flag_fails_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.cli import app
    from kvpilot.launch.args import EngineArgs
    from kvpilot.server import create_app, engine_factory

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if opentelemetry-sdk were absent
    result = CliRunner().invoke(app, ["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318"])
    assert result.exit_code == 2
    assert "pip install 'kvpilot[otel]'" in result.output
    with pytest.raises(TracingUnavailableError, match=r"kvpilot\[otel\]"):
        create_app(engine_factory(EngineArgs()), ServerArgs(otlp_traces_endpoint="http://127.0.0.1:4318"))


@needs_otel
def test_tracing_keeps_the_http_side_torch_free(tmp_path: Path) -> None:
    code = ("import sys; from kvpilot.server import app; from kvpilot.server.observe.tracing import RequestTracer; "
            "RequestTracer('http://127.0.0.1:9', '0').shutdown(); "
            "assert 'opentelemetry.sdk.trace' in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path)
