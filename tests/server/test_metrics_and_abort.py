"""/metrics agrees exactly with the requests sent, and counts an aborted request where docs/server.md says; a
client that disconnects frees its blocks at once."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvpilot.server.background import BackgroundServer
from tests.server.conftest import MODEL
from tests.server.metrics_text import samples, value, wait_idle
from tests.server.tiny_server import AUTH, KEY, tiny_server, write_tiny_config
from tests.server.tiny_server import MODEL as TINY

REQUEST_SERIES = ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                  "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                  "vllm:request_decode_time_seconds_count", "vllm:request_prompt_tokens_count",
                  "vllm:request_generation_tokens_count", "kvpilot:tokenization_time_seconds_count",
                  "kvpilot:serialization_time_seconds_count")


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def _still_settling(state: dict, before: dict, after: dict) -> bool:
    aborted = _delta(before, after, "vllm:request_success_total", finished_reason="abort")
    return bool(state["num_running"] or state["num_used_blocks"]) or aborted < 1


def test_metric_values_match_the_requests(http) -> None:
    wait_idle(http)  # nothing left running by a test before
    before = samples(http)
    prompts = [[1, 2, 3, 4, 5], list(range(200, 220))]  # token ids: exact prompt lengths, no cache hits
    for prompt in prompts:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200
    after = samples(http)
    assert _delta(before, after, "vllm:prompt_tokens_total") == 25
    assert _delta(before, after, "vllm:generation_tokens_total") == 8
    assert _delta(before, after, "vllm:request_success_total", finished_reason="length") == 2
    assert _delta(before, after, "vllm:request_prompt_tokens_sum") == 25
    assert _delta(before, after, "vllm:inter_token_latency_seconds_count") == 2 * 3
    for series in REQUEST_SERIES:
        assert _delta(before, after, series) == 2, series
    assert _delta(before, after, "vllm:iteration_tokens_total_count") >= 4  # at least one step per token
    assert _delta(before, after, "vllm:iteration_tokens_total_sum") >= 25
    assert _delta(before, after, "vllm:prefix_cache_queries_total") == 25 + 0  # one query per prompt token
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    total = value(after, "kvpilot:kv_cache_blocks", state="total")
    assert total == sum(value(after, "kvpilot:kv_cache_blocks", state=s) for s in ("free", "cached", "used")) > 0
    capacity = http.get("/v1/kvpilot/capacity").json()  # vLLM's info gauge says the same as the endpoint
    assert value(after, "vllm:cache_config_info", block_size=str(capacity["block_size"]),
                 num_gpu_blocks=str(int(total)), cache_dtype=capacity["kv_cache_dtype"],
                 enable_prefix_caching=str(capacity["enable_prefix_caching"])) == 1


def test_client_disconnect_mid_stream_frees_blocks(http, live_server) -> None:
    before = samples(http)
    body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live_server.url, headers=http.headers, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert received  # tokens flowed before the client leaves
            busy = http.get("/v1/kvpilot/integrity").json()
            assert busy["num_running"] == 1 and busy["num_used_blocks"] >= 1
    # The core frees the blocks first; the abort's final output reaches the server's metrics a moment later
    # (another process), so wait for both.
    deadline = time.monotonic() + 30
    state, after = http.get("/v1/kvpilot/integrity").json(), samples(http)
    while _still_settling(state, before, after) and time.monotonic() < deadline:
        time.sleep(0.05)
        state, after = http.get("/v1/kvpilot/integrity").json(), samples(http)
    assert state["ok"] and state["num_running"] == 0 and state["num_used_blocks"] == 0
    assert _delta(before, after, "vllm:request_success_total", finished_reason="abort") == 1
    assert _delta(before, after, "vllm:generation_tokens_total") < 500


@pytest.fixture(scope="module")
def one_seat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """A tiny server that runs one request at a time: a second one waits in the queue."""
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config, engine={"max_num_seqs": 1, "max_model_len": 1024, "kv_cache_memory": "16MiB"},
                     api_key=KEY) as running:
        yield running


def _open_completion(server: BackgroundServer, max_tokens: int) -> socket.socket:
    """A non-streaming completion sent on a raw socket (closing it aborts the request)."""
    body = json.dumps({"model": TINY, "prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def _wait(http: httpx.Client, done: Callable[[dict], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not done(http.get("/v1/kvpilot/integrity").json()):
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_request_aborted_before_its_first_token_counts_where_docs_say(one_seat) -> None:
    """docs/server.md, Metrics: E2E and the token-count histograms count every finished request (as
    vllm:request_success_total does); queue time only requests that were scheduled; TTFT, prefill and decode
    only requests that produced a first token (vLLM's rule). A request aborted while waiting is in the first."""
    with httpx.Client(base_url=one_seat.url, headers=AUTH, timeout=30) as http:
        before = samples(http)
        running = _open_completion(one_seat, max_tokens=1000)
        _wait(http, lambda s: s["num_running"] == 1, "the first request never ran")
        waiting = _open_completion(one_seat, max_tokens=4)
        _wait(http, lambda s: s["num_waiting"] == 1, "the second request never queued")
        waiting.close()  # aborted before its first token
        running.close()  # aborted after tokens flowed
        _wait(http, lambda s: s["num_running"] == s["num_waiting"] == s["num_used_blocks"] == 0, "no abort")
        deadline = time.monotonic() + 30
        after = samples(http)
        while _delta(before, after, "vllm:request_success_total") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            after = samples(http)
    assert _delta(before, after, "vllm:request_success_total", finished_reason="abort") == 2
    for series in ("vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                   "vllm:request_generation_tokens_count"):
        assert _delta(before, after, series) == 2, series
    for series in ("vllm:time_to_first_token_seconds_count", "vllm:request_queue_time_seconds_count",
                   "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count"):
        assert _delta(before, after, series) == 1, series
    assert _delta(before, after, "vllm:prompt_tokens_total") == 3  # the prompt that reached its first token
    assert _delta(before, after, "kvpilot:tokenization_time_seconds_count") == 2  # per HTTP request tokenized
    assert _delta(before, after, "kvpilot:serialization_time_seconds_count") == 0  # no response was built
