"""KV offload's visibility on the HTTP side, without a server: vLLM's external prefix-cache counters and the tiers'
series in /metrics, only when offload is on; the response's `tier_cached_tokens` only when a tier served some."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.engine.scheduler_stats import SchedulerStats
from kvpilot.engine.timeline import RequestMetrics, Timeline
from kvpilot.server.observe.metrics import ServerMetrics
from kvpilot.server.observe.stats_logger import TokenTotals, status_line
from kvpilot.server.observe.timings import RequestTimings, kvpilot_field

PLAIN = SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=100,
                       prefix_cache_hits=32, num_preemptions=0, num_free_blocks=6, num_cached_blocks=2,
                       num_used_blocks=0, num_total_blocks=8)


def _render(stats: SchedulerStats) -> str:
    return ServerMetrics("m", lambda: stats, memory=None).render().decode()


def test_offload_series_appear_only_with_offload() -> None:
    assert "external_prefix_cache" not in _render(PLAIN) and "kv_offload" not in _render(PLAIN)
    text = _render(replace(PLAIN, offload_prefix_cache_queries=100, offload_prefix_cache_hits=64,
                           num_offload_blocks=90, num_offload_used_blocks=12, num_offload_saved_blocks=12,
                           num_offload_loaded_blocks=4, num_offload_overlapped_blocks=3))
    assert 'vllm:external_prefix_cache_hits_total{model_name="m"} 64.0' in text
    assert 'vllm:external_prefix_cache_queries_total{model_name="m"} 100.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 32.0' in text  # the pool's own, apart
    assert 'kvpilot:kv_offload_blocks{model_name="m",state="used",tier="cpu"} 12.0' in text
    assert 'kvpilot:kv_offload_copied_blocks_total{direction="load",model_name="m"} 4.0' in text
    assert 'kvpilot:kv_offload_overlapped_blocks_total{model_name="m"} 3.0' in text
    assert 'tier="disk"' not in text


def test_the_response_names_tier_hits_only_when_there_are_some() -> None:
    metrics = RequestMetrics.from_timeline(Timeline(arrival=0.0), request_id="r", num_prompt_tokens=80,
                                           num_cached_tokens=64, num_preemptions=0, finish_reason="length")
    timings = RequestTimings.from_seconds(queue=0, tokenize=0, prefill=0, ttft=0, decode=0, serialize=0, e2e=0)
    assert "tier_cached_tokens" not in kvpilot_field("r", metrics, 80, timings)
    field = kvpilot_field("r", replace(metrics, num_tier_cached_tokens=48), 80, timings)
    assert field["cached_tokens"] == 64 and field["tier_cached_tokens"] == 48


def test_the_status_line_adds_the_tiers_hit_rate_with_offload() -> None:
    totals = TokenTotals(0.0, 0.0)
    assert "External" not in status_line(PLAIN, totals, totals, 1.0)
    offload = replace(PLAIN, num_offload_blocks=90, offload_prefix_cache_queries=100, offload_prefix_cache_hits=64)
    assert status_line(offload, totals, totals, 1.0).endswith("External prefix cache hit rate: 64.0%")


def test_serve_checks_the_offload_flags_before_anything_starts(monkeypatch) -> None:
    from typer.testing import CliRunner

    from kvpilot.cli import app
    from kvpilot.server import cli as serve_cli

    for flags, message in ((["--kv-offloading-backend", "lmcache"], "not supported"),
                           (["--kv-offload-dir", "/tmp"], "give kv_offloading_size too"),
                           (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "needs prefix caching"),
                           (["--kv-offloading-size", "lots"], "is not a size")):
        result = CliRunner().invoke(app, ["serve", *flags])
        assert result.exit_code == 2 and message in result.output, (flags, result.output)
    seen = {}
    monkeypatch.setattr(serve_cli, "_serve", lambda engine_args, *rest: seen.setdefault("args", engine_args) and 0)
    result = CliRunner().invoke(app, ["serve", "--kv-offloading-size", "8", "--kv-offload-dir", "/tmp/kv",
                                      "--kv-offload-dir-size", "1GiB"])
    args = seen["args"]
    assert args.kv_offload_bytes() == (8 * 2**30, 2**30) and args.kv_offload_dir == "/tmp/kv", result.output
