"""A loopback OTLP/HTTP trace collector for tests: takes the exporter's POSTs on /v1/traces and decodes them
with opentelemetry-proto's own protobuf classes, as a real collector does."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    """One decoded span: ids as hex, times in Unix nanoseconds, attributes as plain Python values."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclass
class Collector:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for(self, count: int, timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """The spans once at least `count` arrived (the exporter sends from its own thread)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"the collector got {len(self.spans)} spans, expected {count}")


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def decode(body: bytes) -> list[ReceivedSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(span.name, span.trace_id.hex(), span.span_id.hex(),
                                          span.parent_span_id.hex(), span.kind, span.start_time_unix_nano,
                                          span.end_time_unix_nano, _attributes(span.attributes), resource))
    return spans


@contextmanager
def otlp_collector() -> Iterator[Collector]:
    """A collector on 127.0.0.1 and a free port; `url` has no path (the server appends /v1/traces)."""
    holder: dict[str, Collector] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            collector = holder["c"]
            with collector.lock:
                collector.paths.append(self.path)
                if self.path == TRACES_PATH and self.headers.get("Content-Type") == "application/x-protobuf":
                    collector.spans.extend(decode(body))
            self.send_response(200 if self.path == TRACES_PATH else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder["c"] = Collector(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, name="otlp-collector", daemon=True)
    thread.start()
    try:
        yield holder["c"]
    finally:
        server.shutdown()
        server.server_close()
