"""`kvpilot proxy` (server/disagg): the hand-off's bodies, and the proxy in front of a real kvpilot server.

The disaggregated path end to end (prefill worker -> decode worker, outputs equal) is in
tests/server/test_disaggregation_proxy.py; here: what the proxy itself owes (pass-through, errors, health).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from kvpilot.server.background import BackgroundServer, free_port
from kvpilot.server.disagg.handoff import (KV_TRANSFER_FIELD, HandoffError, WorkerPool, decode_body,
                                           parse_request, prefill_body, prompt_tokens_estimate, transfer_params)
from kvpilot.server.disagg.proxy import ProxyConfig, create_proxy_app
from tests.server.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@contextmanager
def running_proxy(config: ProxyConfig) -> Iterator[str]:
    """The proxy app under uvicorn in a thread on a free port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_proxy_app(config), host="127.0.0.1", port=port,
                                           log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the proxy did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_prompt_tokens_are_exact_for_ids_and_estimated_for_text() -> None:
    assert prompt_tokens_estimate({"prompt": [1, 2, 3]}) == 3
    assert prompt_tokens_estimate({"prompt": [[1, 2], [3]]}) == 3
    assert prompt_tokens_estimate({"prompt": "x" * 40}) == 10
    assert prompt_tokens_estimate({"messages": [{"role": "user", "content": "x" * 20},
                                                {"role": "user", "content": [{"type": "text", "text": "y" * 20}]}]}) == 10


def test_prefill_body_is_one_greedy_unstreamed_token_and_leaves_the_client_body_alone() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True, "temperature": 0.8, "n": 2,
            "stream_options": {"include_usage": True}, "stop": ["\n"]}
    sent = prefill_body(body)
    assert sent == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.0,
                    "stop": ["\n"], KV_TRANSFER_FIELD: {"do_remote_decode": True}}
    assert body["max_tokens"] == 64 and KV_TRANSFER_FIELD not in body
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}
    assert decode_body(body, params) == {**body, KV_TRANSFER_FIELD: params}


def test_handoff_refuses_what_it_cannot_route() -> None:
    with pytest.raises(HandoffError, match="not valid JSON"):
        parse_request(b"{")
    with pytest.raises(HandoffError, match="set by the router"):
        parse_request(b'{"prompt": "x", "kv_transfer_params": {}}')
    with pytest.raises(HandoffError, match="--kv-role prefill") as info:
        transfer_params({"choices": []})
    assert info.value.status == 502


def test_worker_pool_takes_the_least_busy_and_rotates_ties() -> None:
    pool = WorkerPool(("a", "b"))
    assert [pool.pick(), pool.pick()] == ["a", "b"]
    pool.done("a")
    assert pool.pick() == "a"  # b still has one in flight
    pool.done("a"), pool.done("b")
    assert pool.in_flight == {"a": 0, "b": 0}
    assert [pool.pick(), pool.pick()] == ["b", "a"]  # ties rotate: not always the first URL


def test_mixed_proxy_passes_requests_and_streams_through(live_server: BackgroundServer) -> None:
    request = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    direct = httpx.post(f"{live_server.url}/v1/completions", json=request, headers=AUTH, timeout=60).json()
    with running_proxy(ProxyConfig(worker_urls=(live_server.url,))) as url:
        through = httpx.post(f"{url}/v1/completions", json=request, headers=AUTH, timeout=60)
        assert through.status_code == 200
        assert through.headers["x-kvpilot-decode-worker"] == live_server.url
        assert through.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        with httpx.stream("POST", f"{url}/v1/completions", json={**request, "stream": True}, headers=AUTH,
                          timeout=60) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
        unauthorized = httpx.post(f"{url}/v1/completions", json=request, timeout=60)
        assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == 401
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "disaggregated": False}


def test_a_dead_prefill_worker_is_a_503_and_nothing_reaches_the_decode_worker(live_server: BackgroundServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    before = _finished_requests(live_server.url)
    with running_proxy(ProxyConfig(prefill_urls=(dead,), decode_urls=(live_server.url,),
                                   max_local_prefill_tokens=0)) as url:
        answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                            headers=AUTH, timeout=60)
        assert answer.status_code == 503 and dead in answer.json()["error"]["message"]
        assert answer.json()["error"]["type"] == "worker_unavailable"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and dead in health.json()["error"]["message"]
        stats = httpx.get(f"{url}/v1/kvpilot/proxy").json()
        assert stats["num_handoffs"] == 0 and all(n == 0 for n in stats["in_flight"].values())
    assert _finished_requests(live_server.url) == before


def _finished_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_proxy_config_refuses_half_a_deployment() -> None:
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        ProxyConfig(prefill_urls=("http://a",)).check()
    with pytest.raises(ValueError, match="not both"):
        ProxyConfig(prefill_urls=("http://a",), decode_urls=("http://b",), worker_urls=("http://c",)).check()
    with pytest.raises(ValueError, match="give the workers"):
        ProxyConfig().check()
    with pytest.raises(ValueError, match="must be >= 0"):
        ProxyConfig(worker_urls=("http://a",), max_local_prefill_tokens=-1).check()
