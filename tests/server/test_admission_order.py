"""The request cap is decided before tokenizing: a request being tokenized holds its queue slot, and the
next one gets its 429 at once, without its prompt ever reaching the tokenizer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import kvpilot.server.serving as serving
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from tests.server.conftest import server_engine_args
from tests.server.held_tokenizer import HeldTokenizer


@pytest.fixture()
def one_slot_server(llm_fp32):
    app = create_app(engine_factory(server_engine_args(), llm_fp32.loaded, warmup=False),
                     ServerArgs(served_model_names=("m",), max_num_queued_reqs=1, engine_process=False))
    with BackgroundServer(app) as server:
        yield server


def test_request_cap_429_comes_before_tokenizing(one_slot_server, monkeypatch) -> None:
    held = HeldTokenizer(hold=lambda body: body.prompt == "HOLD")
    monkeypatch.setattr(serving, "tokenize_request", held)
    body = {"model": "m", "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=one_slot_server.url, timeout=120) as client, ThreadPoolExecutor(1) as background:
        first = background.submit(client.post, "/v1/completions", json={**body, "prompt": "HOLD"})
        try:
            assert held.held.wait(120)  # the first request is being tokenized: it holds the only slot
            with httpx.Client(base_url=one_slot_server.url, timeout=120) as other:
                rejected = other.post("/v1/completions", json={**body, "prompt": "next"})
            assert rejected.status_code == 429, rejected.text
            assert rejected.json()["error"]["type"] == "queue_full_requests"
            assert len(held.threads) == 1  # the rejected prompt was never tokenized
        finally:
            held.release.set()
        assert first.result(timeout=120).status_code == 200
        assert client.post("/v1/completions", json={**body, "prompt": "next"}).status_code == 200
