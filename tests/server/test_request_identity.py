"""Request identity across hops: a client's X-Request-Id is kept in the engine's request id, the response id
and the access log, and echoed on every response (streamed, whole, error); a duplicate in flight is refused."""

from __future__ import annotations

import json
import logging

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import kvpilot.server.serving as serving
from tests.server.conftest import MODEL
from tests.server.held_tokenizer import HeldTokenizer


def test_the_client_id_is_kept_everywhere(http, caplog) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="kvpilot.access"):
        whole = http.post("/v1/completions", json=body, headers={"X-Request-Id": "gw-123.a"})
    assert whole.status_code == 200 and whole.headers["x-request-id"] == "gw-123.a"
    assert whole.json()["id"] == "cmpl-gw-123.a"
    assert any(json.loads(r.getMessage()).get("request_id") == "cmpl-gw-123.a" for r in caplog.records
               if r.getMessage().startswith("{"))
    with http.stream("POST", "/v1/completions", json={**body, "stream": True},
                     headers={"X-Request-Id": "gw-124"}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert streamed.headers["x-request-id"] == "gw-124" and chunks and all(c["id"] == "cmpl-gw-124" for c in chunks)


def test_errors_echo_the_id_and_bad_ids_are_refused(http, live_server) -> None:
    missing = http.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"X-Request-Id": "gw-9"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "gw-9"
    unauthorized = httpx.post(f"{live_server.url}/v1/completions", json={}, headers={"X-Request-Id": "gw-10"})
    assert unauthorized.status_code == 401 and unauthorized.headers["x-request-id"] == "gw-10"
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1})
    assert plain.headers["x-request-id"] == plain.json()["id"]  # no client id: the engine's own


def test_a_duplicate_id_in_flight_gets_409(http, live_server) -> None:
    # The first runs in the engine when the second arrives (1000 tokens: seconds; leaving the `with` aborts it).
    long = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=live_server.url, headers=http.headers, timeout=120) as other:
        with other.stream("POST", "/v1/completions", json=long, headers={"X-Request-Id": "dup-1"}) as first:
            lines = first.iter_lines()
            started = next(line for line in lines if line.startswith("data:"))
            second = http.post("/v1/completions", json={**long, "stream": False, "max_tokens": 1},
                               headers={"X-Request-Id": "dup-1"})
            if second.status_code != 409:  # say what the first did, to tell a slow id check from a short run
                rest = [line for line in lines if line.startswith("data:")]
                raise AssertionError(f"second got {second.status_code}; the first began {started[:200]!r} and "
                                     f"sent {len(rest)} more events, the last {rest[-2:]!r}")
            assert "dup-1" in second.json()["error"]["message"]


@pytest.mark.parametrize("first_n,second_n", [(1, 1), (2, 1), (1, 2)])
def test_a_duplicate_id_is_refused_from_arrival_on(http, live_server, monkeypatch, first_n, second_n) -> None:
    """From the moment it arrives (held here while it is tokenized, before the engine knows it), a request's id
    is taken, fanned out (`n`: sub-requests `<id>-0`, `<id>-1`) or not, whichever of the two fans out."""
    held = HeldTokenizer(hold=lambda body: body.prompt == "HOLD")
    monkeypatch.setattr(serving, "tokenize_request", held)
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    headers = {**http.headers, "X-Request-Id": "dup-2"}
    with ThreadPoolExecutor(1) as background:
        first = background.submit(http.post, "/v1/completions", json={**body, "prompt": "HOLD", "n": first_n},
                                  headers=headers)
        try:
            assert held.held.wait(120)
            with httpx.Client(base_url=live_server.url, headers=headers, timeout=120) as other:
                second = other.post("/v1/completions", json={**body, "prompt": "next", "n": second_n})
            assert second.status_code == 409, second.text
            assert len(held.threads) == 1  # refused before tokenizing
        finally:
            held.release.set()
        assert first.result(timeout=120).status_code == 200
    again = http.post("/v1/completions", json={**body, "prompt": "next", "n": second_n}, headers=headers)
    assert again.status_code == 200  # the id is free once the first has finished
