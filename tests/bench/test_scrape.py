"""Prometheus scraping: vLLM names old and new, summaries, and scraping during a run."""

from __future__ import annotations

import pytest

from kvpilot.bench.load import LoadShape
from kvpilot.bench.scrape import MetricsSample, known_samples, parse_metrics, summarize
from tests.doubles.scripted_process import ScriptedProcess
from tests.doubles.scripted_server import Behavior

from .scripted_helpers import run_scripted

NEW = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3
vllm:num_requests_running{engine="1"} 2
vllm:num_requests_waiting 7
vllm:kv_cache_usage_perc 0.5
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total 4
vllm:num_preemptions_created 1.7e9
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total 100
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total 25
"""
OLD = """vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.4
vllm:num_preemptions_total{model_name="m"} 2
"""


def test_parse_new_and_old_names() -> None:
    assert parse_metrics(NEW) == {"running": 5.0, "waiting": 7.0, "kv_usage": 0.5, "preemptions": 4.0,
                                  "prefix_queries": 100.0, "prefix_hits": 25.0}
    assert parse_metrics(OLD) == {"kv_usage": 0.25, "prefix_hit_rate": 0.4, "preemptions": 2.0}
    two_engines = 'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.6\n'
    assert parse_metrics(two_engines)["kv_usage"] == pytest.approx(0.4)  # ratios average


def test_summary_uses_counter_deltas_and_gauges_during() -> None:
    samples = [MetricsSample(0.0, "before", {"preemptions": 1, "prefix_queries": 100, "prefix_hits": 10,
                                             "kv_usage": 0.0}),
               MetricsSample(1.0, "during", {"kv_usage": 0.6, "waiting": 4}),
               MetricsSample(2.0, "during", {"kv_usage": 0.2, "waiting": 0}),
               MetricsSample(3.0, "after", {"preemptions": 4, "prefix_queries": 300, "prefix_hits": 110,
                                            "kv_usage": 0.0})]
    s = summarize(samples)
    assert s.kv_usage_max == 0.6 and s.kv_usage_mean == pytest.approx(0.4) and s.waiting_max == 4
    assert s.num_preemptions == 3 and s.prefix_cache_hit_rate == pytest.approx(0.5)


def test_llama_servers_hit_rate_is_the_runs_own() -> None:
    """llama-server counts cached and processed prompt tokens apart: the run's hit rate is its cached tokens over
    both, from the deltas over the run (a probe's earlier phases of unique prompts do not dilute it)."""
    text = ("llamacpp:prompt_tokens_total {processed}\nllamacpp:prompt_tokens_cached_total {cached}\n"
            "llamacpp:kv_cache_usage_ratio 0.1\n")
    before = parse_metrics(text.format(processed=5000, cached=100))
    assert before == {"processed_prompt_tokens": 5000.0, "cached_prompt_tokens": 100.0, "kv_usage": 0.1}
    after = parse_metrics(text.format(processed=5720, cached=532))
    s = summarize([MetricsSample(0.0, "before", before), MetricsSample(2.0, "after", after)])
    assert s.prefix_cache_hit_rate == pytest.approx(432 / (432 + 720)) and s.prefix_cache_hits == 432


def test_scrapes_before_during_after_a_run(scripted: ScriptedProcess) -> None:
    scripted.set_script(Behavior(ttft_s=0.05, itl_s=0.01, num_output_tokens=20, num_cached_tokens=4,
                                 num_preemptions=1))
    out = run_scripted(scripted, LoadShape(concurrency=4, num_requests=8), num_items=8, metrics=True)
    phases = [s.phase for s in out.metrics]
    assert phases[0] == "before" and phases[-1] == "after" and "during" in phases
    s = summarize(out.metrics)
    assert s.running_max is not None and s.running_max >= 2  # the server saw requests in flight
    assert s.num_preemptions == 8 and s.prefix_cache_hit_rate == pytest.approx(32 / (8 * 16))


def test_only_known_series_are_parsed() -> None:
    """The load generator parses only what it reads: a full exposition (histogram buckets of every
    latency series) took ~15 ms to parse on its event loop, which showed up as client lag."""
    buckets = "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{le}"}} {i}\n' for i, le in enumerate(range(200)))
    text = "# HELP vllm:e2e_request_latency_seconds E2E.\n# TYPE vllm:e2e_request_latency_seconds histogram\n"
    text += buckets + NEW
    kept = known_samples(text).splitlines()
    assert kept and all(line.startswith("vllm:") and "e2e" not in line for line in kept)
    assert parse_metrics(text) == parse_metrics(NEW)
