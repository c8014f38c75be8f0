"""Start-up without a model: /health is 503 while the engine loads and after it fails; requests get 503."""

from __future__ import annotations

import threading

import httpx

from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.server import ServerArgs, create_app
from kvpilot.server.background import BackgroundServer
from kvpilot.server.observe.stats_logger import TokenTotals, status_line


def test_health_is_503_while_loading_then_after_a_failed_load() -> None:
    release = threading.Event()

    def slow_failing_factory():
        release.wait(30)
        raise RuntimeError("weights are corrupt")

    app = create_app(slow_failing_factory, ServerArgs(served_model_names=("m",), engine_process=False))
    with BackgroundServer(app, wait_ready=False) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        loading = client.get("/health")
        assert loading.status_code == 503 and loading.json()["error"]["type"] == "loading"
        refused = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert refused.status_code == 503 and "still loading" in refused.json()["error"]["message"]
        assert refused.headers["Retry-After"] == "5"
        release.set()
        for _ in range(300):
            failed = client.get("/health")
            if failed.json()["error"]["type"] == "engine_failed":
                break
            threading.Event().wait(0.01)
        assert failed.status_code == 503 and "weights are corrupt" in failed.json()["error"]["message"]


def test_status_line_reports_throughput_and_state() -> None:
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                           prefix_cache_hits=40, num_preemptions=0, num_free_blocks=1, num_cached_blocks=1,
                           num_used_blocks=2, num_total_blocks=4)
    line = status_line(stats, TokenTotals(0, 0), TokenTotals(500, 100), 5.0)
    assert "prompt throughput: 100.0 tokens/s" in line and "generation throughput: 20.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 2 reqs" in line and "KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 40.0%" in line
