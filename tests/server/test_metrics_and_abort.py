"""/metrics agrees exactly with the requests sent; a client that disconnects frees its blocks at once."""

from __future__ import annotations

import time

import httpx

from tests.server.conftest import MODEL
from tests.server.metrics_text import samples, value, wait_idle

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
