"""Pushed chunks through the real server and sockets (push_stream.py): a stream gets exactly the tokens of the
same request unstreamed, one chunk a step, also when its client stops reading until the server's socket and
transport buffers are full (the pushed send suspends, then the rest follows in order).

Loopback TCP grows a send buffer to 4 MiB, so the server's is pinned small (SO_SNDBUF on the listening socket,
which accepted sockets inherit) and the client's receive buffer too: 8 + 8 KiB in the kernel, then uvicorn's
transport pauses at 64 KiB."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.server.background import BackgroundServer

from .tiny_server import AUTH, MODEL, tiny_server, write_tiny_config

NUM_TOKENS = 800  # ~135 KB of chunks, one a token: past the buffers (~80 KiB)
SMALL_BUFFER = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = write_tiny_config(tmp_path_factory.mktemp("push"), narrow=True)  # 1,600 tokens in the slow test
    with tiny_server(config, engine={"max_model_len": 1024}) as running:
        for listener in running.server.servers:
            for sock in listener.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        yield running


def _body(stream: bool, max_tokens: int, chat: bool = False) -> dict:
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "Tell me about printing presses"}]
    else:
        body["prompt"] = "The history of the printing press"
    return body


def _chunks(lines: Iterator[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_carries_the_unstreamed_answer_one_chunk_a_token(server: BackgroundServer, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        whole = http.post(path, json=_body(False, 40, chat)).json()
        with http.stream("POST", path, json=_body(True, 40, chat)) as response:
            chunks = _chunks(response.iter_lines())
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        pieces, expected = [c["delta"].get("content", "") for c in choices[1:]], whole["choices"][0]["message"]["content"]
        running = choices[1:-1]
    else:
        pieces, expected, running = [c["text"] for c in choices], whole["choices"][0]["text"], choices[:-1]
    assert "".join(pieces) == expected
    assert len(running) == 39 and all(c["finish_reason"] is None for c in running)
    assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 40


def test_a_client_that_stops_reading_still_gets_every_chunk_in_order(server: BackgroundServer) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        whole = http.post("/v1/completions", json=_body(False, NUM_TOKENS)).json()["choices"][0]["text"]
        small_window = httpx.HTTPTransport(socket_options=SMALL_BUFFER)
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60, transport=small_window) as slow, \
                slow.stream("POST", "/v1/completions", json=_body(True, NUM_TOKENS)) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            _wait_until_generated(http)  # meanwhile nothing is read: the server's writes back up
            chunks = [json.loads(first[6:]), *_chunks(lines)]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == whole
    # Fewer chunks than tokens: once a send waited on the full socket, the steps behind it queued for the
    # handler, which merges what queued (sub_requests.py, Coalescing); nothing pushed would have merged.
    assert len(texts) < NUM_TOKENS
    assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS


def _wait_until_generated(http: httpx.Client) -> None:
    deadline = time.monotonic() + 60
    while http.get("/v1/kvpilot/integrity").json()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
