"""Issue 14, serving hardening, against a live server: the API key guards every route but /health, request
bodies are bounded in size and time, slow or silent clients and endless request heads are dropped, the
contract (/health body, 405 Allow, OpenAPI 400 not 422) holds, and a non-streaming client that leaves has its
request aborted at once."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from http.client import HTTPConnection

import httpx
import pytest

from kvpilot.server.background import BackgroundServer
from kvpilot.server.guards.slow_clients import MAX_HEADER_BYTES
from tests.server.metrics_text import samples, value
from tests.server.tiny_server import AUTH, KEY, MODEL, integrity, tiny_server, write_tiny_config

MAX_BODY = 2 * 1024 * 1024
GUARDED_PATHS = ("/metrics", "/docs", "/redoc", "/openapi.json", "/version", "/v1/models", "/v1/kvpilot/capacity",
                 "/v1/kvpilot/integrity", "/no-such-route")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config, api_key=KEY, max_request_body_bytes=MAX_BODY, header_timeout_s=1.0,
                     body_timeout_s=1.0, keep_alive_timeout_s=1.0) as running:
        yield running


@pytest.fixture()
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def _raw(server: BackgroundServer, data: bytes, timeout_s: float = 15.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s)
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("path", GUARDED_PATHS)
def test_every_route_but_health_needs_the_key(server, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer"}, {"Authorization": KEY}):
        response = httpx.get(server.url + path, headers=headers, timeout=30)
        assert response.status_code == 401, (path, headers, response.text)
        assert response.json()["error"]["code"] == 401 and response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + path, headers=AUTH, timeout=30).status_code != 401


def test_health_is_open_and_a_small_json_body(server) -> None:
    response = httpx.get(server.url + "/health", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json" and response.json() == {"status": "ok"}


def test_method_not_allowed_carries_allow(http) -> None:
    response = http.get("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == 405


def test_openapi_says_400_with_the_openai_error_body(http) -> None:
    schema = http.get("/openapi.json").json()
    assert '"422"' not in str(schema).replace("'", '"')
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    error = schema["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert "401" not in schema["paths"]["/health"]["get"]["responses"]


def test_a_huge_model_name_is_not_echoed_back(http) -> None:
    response = http.post("/v1/completions", json={"model": "m" * 1_000_000, "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 404
    assert len(response.content) < 2_000 and "m" * 256 in response.json()["error"]["message"]


def test_declared_oversize_body_gets_413_before_it_is_sent(server) -> None:
    sock = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
    with sock:
        reply = _read_all(sock)  # no body byte sent: the answer cannot have waited for it
    assert reply.startswith(b"HTTP/1.1 413 ") and b"--max-request-body-bytes" in reply


def test_chunked_oversize_body_gets_413(http) -> None:
    sent = []

    def body() -> Iterator[bytes]:
        for _ in range(MAX_BODY // 65536 * 4):
            sent.append(65536)
            yield b" " * 65536

    response = http.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"
    print(f"\nchunked upload: 413 after {sum(sent)} of {MAX_BODY * 4} bytes offered")


def _post_with_http_client(server: BackgroundServer, num_bytes: int, chunked: bool) -> tuple[int, bytes]:
    """Posts `num_bytes` as http.client does: the whole body first, only then the response is read (a reset
    while sending raises ConnectionResetError or BrokenPipeError)."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {**AUTH, "Content-Type": "application/json"}
    if not chunked:
        headers["Content-Length"] = str(num_bytes)
    try:
        conn.request("POST", "/v1/completions", body=(b" " * 65536 for _ in range(num_bytes // 65536)),
                     headers=headers, encode_chunked=chunked)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_oversize_body_gets_413_with_a_client_that_reads_only_after_sending(server, chunked: bool) -> None:
    """The 413 is sent at once and the rest of the body read and discarded (up to a bound) before the
    connection closes: closed with unread data, the socket would reset and the client never read the 413."""
    status, body = _post_with_http_client(server, 4 * MAX_BODY, chunked)
    assert status == 413 and b"--max-request-body-bytes" in body


def test_oversize_body_with_expect_continue_is_refused_without_waiting_for_it(server) -> None:
    """A client that waits for "100 Continue" gets the 413 instead, and no 100 (it would then send a body)."""
    sock = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n"
                % (2 * MAX_BODY))
    started = time.monotonic()
    with sock:
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in reply
    assert time.monotonic() - started < 0.5  # closed at once, not after the 1 s body deadline


def test_slow_body_gets_408_and_the_connection_closed(server) -> None:
    started = time.monotonic()
    sock = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
    with sock:
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in reply
    print(f"\nslow body (timeout 1 s): 408 and closed after {time.monotonic() - started:.2f} s")


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"], ids=["silent", "slow"])
def test_slow_headers_get_dropped(server, sent: bytes) -> None:
    started = time.monotonic()
    with _raw(server, sent) as sock:
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") if sent else reply == b""
    print(f"\nheaders {'partly sent' if sent else 'never sent'} (timeout 1 s): closed after "
          f"{time.monotonic() - started:.2f} s")


def test_an_endless_request_head_is_refused_and_others_are_served(server, http) -> None:
    """Header lines that never end: refused past MAX_HEADER_BYTES (431 on httptools, h11's own 400), well before
    the header deadline, while a completion on another connection is served."""
    lines = b"".join(b"x-pad-%d: %s\r\n" % (i, b"v" * 100) for i in range(4 * MAX_HEADER_BYTES // 112))
    started = time.monotonic()
    with _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + lines) as sock:
        reply = _read_all(sock)
    assert reply.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 400 ")) and time.monotonic() - started < 1.0
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert integrity(http)["ok"]


def test_non_streaming_client_that_leaves_is_aborted(server, http) -> None:
    before = samples(http)
    # Greedy: steps take milliseconds, so outputs never pause long enough for a poll between them to run.
    body = (b'{"model": "%s", "prompt": "Once upon a time", "max_tokens": 240, "temperature": 0, '
            b'"ignore_eos": true}' % MODEL.encode())
    sock = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 60
    while integrity(http)["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.01)
    sock.close()  # the client leaves while tokens are flowing
    while integrity(http)["num_running"]:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.01)
    # the integrity reply can overtake the step that carries the aborted request's final output (the core
    # answers queries before it steps): wait for the abort to be counted
    aborted = 0.0
    while aborted < 1 and time.monotonic() < deadline:
        after = samples(http)
        aborted = value(after, "vllm:request_success_total", finished_reason="abort") - \
            value(before, "vllm:request_success_total", finished_reason="abort")
        time.sleep(0.01)
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert aborted == 1 and generated < 240
    state = integrity(http)
    assert state["ok"] and state["num_used_blocks"] == 0
