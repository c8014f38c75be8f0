"""The token counters move per engine step (as vLLM's do): a long request's generated tokens show in /metrics
and in the status line while it runs; a prompt counts once, at its first token, even when preempted."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpilot.engine.engine import StepStats
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from kvpilot.server.observe.metrics import ServerMetrics
from kvpilot.server.observe.stats_logger import TokenTotals, status_line
from tests.server.conftest import MODEL, server_engine_args
from tests.server.metrics_text import samples, value, wait_idle

PROMPT = list(range(300, 312))  # token ids: an exact prompt length


def _totals(all_samples: dict) -> TokenTotals:
    return TokenTotals(value(all_samples, "vllm:prompt_tokens_total"),
                       value(all_samples, "vllm:generation_tokens_total"))


def _chunks(lines: Iterator[str], n: int) -> None:
    for _ in range(n):
        next(line for line in lines if line.startswith("data: {"))


def _throughputs(line: str) -> tuple[float, float]:
    found = re.search(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+)", line)
    assert found, line
    return float(found.group(1)), float(found.group(2))


def test_generation_counter_moves_while_a_long_request_runs(http, live_server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}
    wait_idle(http)
    before = samples(http)
    with httpx.Client(base_url=live_server.url, headers=http.headers, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            _chunks(lines, 10)
            early, t_early = samples(http), time.monotonic()
            _chunks(lines, 30)  # an interval in which this request only decodes
            later, t_later = samples(http), time.monotonic()
            list(lines)
    after = samples(http)
    generated = [_totals(s).num_generation_tokens - _totals(before).num_generation_tokens for s in (early, after)]
    assert 0 < generated[0] < 100 and generated[1] == 100
    assert _totals(early).num_prompt_tokens - _totals(before).num_prompt_tokens == len(PROMPT)  # at its first token
    line = status_line(live_server.state.client.stats, _totals(early), _totals(later), t_later - t_early)
    prompt_tps, generation_tps = _throughputs(line)
    assert prompt_tps == 0.0 and generation_tps > 0.0


def test_step_hook_counts_sampled_tokens_and_the_prompt_once() -> None:
    metrics = ServerMetrics("m", lambda: None)
    read = metrics.registry.get_sample_value
    step = dict(num_batched_tokens=3, num_prefill_tokens=0, num_decode_tokens=3, num_scheduled_seqs=3,
                num_preempted=0, duration=0.01)
    metrics.observe_step(StepStats(**step, num_generated_tokens=3))
    metrics.observe_step(StepStats(**step, num_generated_tokens=2))  # a finished request's token is not one
    metrics.observe_prefill_done(12)
    assert read("vllm:generation_tokens_total", {"model_name": "m"}) == 5
    assert read("vllm:prompt_tokens_total", {"model_name": "m"}) == 12
    assert read("vllm:iteration_tokens_total_count", {"model_name": "m"}) == 2


@pytest.fixture()
def small_cache_server(llm_fp32):
    """A KV cache of a few blocks and max_model_len as large as the cache: two long requests must preempt."""
    app = create_app(engine_factory(server_engine_args(kv_cache_memory="4MiB", max_model_len=64), llm_fp32.loaded,
                                    warmup=False), ServerArgs(served_model_names=("m",), engine_process=False))
    with BackgroundServer(app) as server:
        yield server


def test_preempted_prompt_is_counted_once(small_cache_server) -> None:
    with httpx.Client(base_url=small_cache_server.url, timeout=120) as client:
        blocks = value(samples(client), "kvpilot:kv_cache_blocks", state="total")
        assert 64 <= blocks * 16 < 128, f"{blocks} blocks: adjust kv_cache_memory so two requests cannot fit"
        before = samples(client)
        prompts = [list(range(400, 416)), list(range(500, 516))]
        with httpx.Client(base_url=small_cache_server.url, timeout=120) as other:
            streams = [c.stream("POST", "/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 48,
                                                                  "ignore_eos": True, "temperature": 0, "stream": True})
                       for c, p in zip((client, other), prompts)]
            responses = [s.__enter__() for s in streams]
            try:
                for response in responses:
                    assert response.status_code == 200
                    list(response.iter_lines())
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        after = samples(client)
    delta = {name: value(after, name) - value(before, name) for name in (
        "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:request_prompt_tokens_sum")}
    assert delta["vllm:num_preemptions_total"] >= 1
    assert delta["vllm:prompt_tokens_total"] == delta["vllm:request_prompt_tokens_sum"] == 32  # not recounted
    assert delta["vllm:generation_tokens_total"] == 2 * 48
