"""Request identity across hops: a client's X-Request-Id is kept in the engine's request id, the response id
and the access log, and echoed on every response (streamed, whole, error); a duplicate in flight is refused."""

from __future__ import annotations

import json
import logging

import httpx

from tests.server.conftest import MODEL


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
    # As long as the context allows (~4 s here): the first must still run when the second arrives, however late
    # a loaded box sends it (200 tokens, ~1 s, once ran out first); leaving the `with` aborts it.
    long = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=live_server.url, headers=http.headers, timeout=120) as other:
        with other.stream("POST", "/v1/completions", json=long, headers={"X-Request-Id": "dup-1"}) as first:
            next(line for line in first.iter_lines() if line.startswith("data:"))  # it runs
            second = http.post("/v1/completions", json={**long, "stream": False, "max_tokens": 1},
                               headers={"X-Request-Id": "dup-1"})
            assert second.status_code == 409 and "dup-1" in second.json()["error"]["message"]
