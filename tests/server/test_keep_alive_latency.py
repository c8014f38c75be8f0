"""Issue 43: a response on a kept-alive connection is as fast as one on a fresh connection.

Without TCP_NODELAY on accepted connections, a response's body (written after its head) waited for the
client's delayed ACK: ~40 ms on every request after a connection's first. A real `python -m kvpilot.server`
process (the listening socket `kvpilot serve` binds) on a 2-layer dummy model, and kvpilot's uvicorn protocol on a
listener made with proto 0 (on which asyncio sets no TCP_NODELAY), timed with http.client (which sets
TCP_NODELAY on its own side, so only the server's side is measured).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn

from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.server.background import free_port
from kvpilot.server.guards.slow_clients import HttpToolsProtocol, header_timeout_protocol
from tests.served_process import serve_process

ROUNDS = 15
# Well under the ~40 ms of a delayed ACK, above a loaded 2-core box's noise on a median
MARGIN_MS = 3.0


@pytest.fixture(scope="module")
def server_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    directory = tmp_path_factory.mktemp("dummy")
    config = get_hf_config("smollm2-135m")
    config.update(num_hidden_layers=2, vocab_size=4096)  # a step of a few ms
    (directory / "config.json").write_text(json.dumps(config))
    port = free_port()
    command = [sys.executable, "-m", "kvpilot.server", "--model", str(directory / "config.json"),
               "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
               "--port", str(port), "--served-model-name", "dummy"]
    with serve_process(command, f"http://127.0.0.1:{port}", directory / "server.log"):
        yield port


def _connect(port: int) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.connect()
    return connection


def _timed(connection: http.client.HTTPConnection, method: str, path: str,
           body: dict | None = None) -> tuple[float, bytes]:
    """(ms from sending the request to having read the whole response, the body); status 200 asserted."""
    data = None if body is None else json.dumps(body).encode()
    start = time.perf_counter()
    connection.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
    response = connection.getresponse()
    content = response.read()
    elapsed_ms = (time.perf_counter() - start) * 1000.0
    assert response.status == 200, response.status
    return elapsed_ms, content


def _health_ms(connection: http.client.HTTPConnection) -> float:
    return _timed(connection, "GET", "/health")[0]


def _completion_outside_server_ms(connection: http.client.HTTPConnection) -> float:
    """A 1-token completion's client time less the server's own e2e_ms (arrival to the body handed to the
    transport): the transfer alone, without the model step, whose time a busy box varies by 100 ms."""
    body = {"model": "dummy", "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0}
    elapsed_ms, content = _timed(connection, "POST", "/v1/completions", body)
    return elapsed_ms - json.loads(content)["kvpilot"]["timings"]["e2e_ms"]


def _medians(port: int, send: Callable[[http.client.HTTPConnection], float]) -> tuple[float, float]:
    """(kept-alive, fresh) medians of ROUNDS requests each, taken in turns so that a busy moment of the box
    slows both: one connection serves every kept-alive request (after a first, untimed one), each fresh request
    gets a new connection (connected before the timer starts)."""
    kept = _connect(port)
    send(kept)
    kept_ms, fresh_ms = [], []
    for _ in range(ROUNDS):
        kept_ms.append(send(kept))
        fresh = _connect(port)
        fresh_ms.append(send(fresh))
        fresh.close()
    kept.close()
    return statistics.median(kept_ms), statistics.median(fresh_ms)


def test_health_on_a_kept_alive_connection_is_as_fast_as_on_a_fresh_one(server_port: int) -> None:
    kept, fresh = _medians(server_port, _health_ms)
    assert kept <= fresh + MARGIN_MS, f"kept-alive median {kept:.2f} ms, fresh {fresh:.2f} ms"


def test_completion_on_a_kept_alive_connection_is_as_fast_as_on_a_fresh_one(server_port: int) -> None:
    kept, fresh = _medians(server_port, _completion_outside_server_ms)
    assert kept <= fresh + MARGIN_MS, f"outside the server: kept-alive median {kept:.2f} ms, fresh {fresh:.2f} ms"


async def _two_writes(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with its head and body written apart, as uvicorn writes a JSON response."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    HttpToolsProtocol is None, reason="httptools is not installed"))])
def protocol_port(request: pytest.FixtureRequest) -> Iterator[int]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # proto 0: asyncio leaves Nagle on
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    config = uvicorn.Config(_two_writes, loop="asyncio", log_level="warning", lifespan="off",
                            http=header_timeout_protocol(10.0, request.param))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield listener.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


def test_the_protocol_sets_nodelay_whoever_made_the_listener(protocol_port: int) -> None:
    kept, fresh = _medians(protocol_port, lambda connection: _timed(connection, "GET", "/")[0])
    assert kept <= fresh + MARGIN_MS, f"kept-alive median {kept:.2f} ms, fresh {fresh:.2f} ms"
