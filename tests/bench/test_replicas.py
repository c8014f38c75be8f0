"""Per-replica reports: `/metrics/replicas` parsing, counter deltas, imbalance, prefix spread and offered reuse,
with exact numbers; the JSON section round-trips. (Real servers: test_replicas_e2e.py.)"""

from __future__ import annotations

import pytest

from kvpilot.bench.replica_report import (ReplicaReport, build_report, imbalance, offered_reuse,
                                          prefix_spread)
from kvpilot.bench.records import RequestRecord
from kvpilot.bench.replicas import (ReplicaPlan, ReplicaSample, ReplicaValues, aggregate, parse_labelled,
                                    parse_replica_values)
from kvpilot.bench.scrape import parse_metrics

LABELLED = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",replica="r1",lane="short"} 3
vllm:num_requests_running{model_name="m",replica="r2",lane="short"} 1
vllm:num_requests_running{model_name="m",replica="r3",lane="long"} 0
vllm:num_requests_running{model_name="m"} 4
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",replica="r1",lane="short"} 0.2
vllm:kv_cache_usage_perc{engine="1",replica="r1",lane="short"} 0.4
vllm:kv_cache_usage_perc{engine="0",replica="r2",lane="short"} 0.5
# HELP vllm:prefix_cache_queries Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{replica="r1",lane="short"} 1000
vllm:prefix_cache_queries_created{replica="r1",lane="short"} 1.7e9
vllm:prefix_cache_queries_total{replica="r2",lane="short"} 500
vllm:prefix_cache_queries_total{replica="r3",lane="long"} 4000
# HELP vllm:prefix_cache_hits Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{replica="r1",lane="short"} 250
vllm:prefix_cache_hits_total{replica="r2",lane="short"} 0
vllm:prefix_cache_hits_total{replica="r3",lane="long"} 1000
# HELP vllm:request_success Count of successfully processed requests.
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m",replica="r1",lane="short"} 4
vllm:request_success_total{finished_reason="length",model_name="m",replica="r1",lane="short"} 6
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",replica="r1",lane="short"} 3
"""


def test_labelled_exposition_groups_by_replica() -> None:
    reps = parse_labelled(LABELLED)
    assert sorted(reps) == ["r1", "r2", "r3"]  # the unlabelled aggregate line is no replica
    assert reps["r1"] == ReplicaValues("short", {"running": 3.0, "kv_usage": pytest.approx(0.3),
                                                 "prefix_queries": 1000.0, "prefix_hits": 250.0,
                                                 "requests_ok": 10.0})
    assert reps["r2"] == ReplicaValues("short", {"running": 1.0, "kv_usage": 0.5, "prefix_queries": 500.0,
                                                 "prefix_hits": 0.0})
    assert reps["r3"] == ReplicaValues("long", {"running": 0.0, "prefix_queries": 4000.0, "prefix_hits": 1000.0})
    assert parse_labelled("vllm:num_requests_running 3\n") == {}  # a plain server's exposition
    assert parse_metrics(LABELLED)["prefix_queries"] == 5500.0  # the aggregate reader still sums every label set


def test_one_servers_metrics_and_the_deployment_sum() -> None:
    own = parse_replica_values('vllm:prompt_tokens_total{model_name="m"} 640\nvllm:num_requests_waiting 2\n')
    assert own == ReplicaValues(None, {"waiting": 2.0, "prompt_tokens": 640.0})
    sample = ReplicaSample(1.0, "during", parse_labelled(LABELLED))
    total = aggregate(sample)
    assert total.values == {"running": 4.0, "kv_usage": pytest.approx(0.4), "prefix_queries": 5500.0,
                            "prefix_hits": 1250.0}  # summed; the ratio averaged over replicas; no replica-only keys
    assert (total.t_s, total.phase) == (1.0, "during")


def test_plan_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError):
        ReplicaPlan()
    with pytest.raises(ValueError):
        ReplicaPlan(labelled_url="http://x/metrics/replicas", urls=("http://a",))
    with pytest.raises(ValueError):
        ReplicaPlan(labelled_url="http://x/metrics/replicas", route=True)


def rec(i: int, replica: str | None, group: str | None, sent_s: float, *, ok: bool = True, ttft_ms: float = 100.0,
        prompt: int = 100) -> RequestRecord:
    return RequestRecord(
        request_index=i, item_id=i, turn_index=0, group_id=group, ok=ok, status=200 if ok else 500,
        error_kind=None if ok else "http_status", error=None if ok else "HTTP 500", scheduled_s=sent_s,
        sent_s=sent_s, queue_wait_ms=0.0, sched_lag_ms=0.0, ttft_ms=ttft_ms if ok else None, e2e_ms=200.0,
        itl_ms=(), num_prompt_tokens=prompt, num_output_tokens=1, output_tokens_source="usage", num_chunks=1,
        replica=replica)


RECORDS = [rec(0, "r1", "prefix-0", 0.0), rec(1, "r2", "prefix-0", 0.05), rec(2, "r1", "prefix-0", 0.2),
           rec(3, "r1", "prefix-1", 0.0), rec(4, "r1", "prefix-1", 0.3), rec(5, "r2", "prefix-2", 0.4, ok=False),
           rec(6, "r1", None, 0.5)]


def _sample(t: float, phase: str, r1: dict[str, float], r2: dict[str, float]) -> ReplicaSample:
    return ReplicaSample(t, phase, {"r1": ReplicaValues("short", r1), "r2": ReplicaValues("short", r2)})


SAMPLES = [
    _sample(0.0, "before", {"prefix_queries": 100, "prefix_hits": 10, "prompt_tokens": 100, "requests_ok": 1,
                            "running": 0, "waiting": 0},
            {"prefix_queries": 50, "prefix_hits": 0, "running": 0}),  # r2 has no request counters yet
    _sample(1.0, "during", {"running": 2, "waiting": 1}, {"running": 1, "waiting": 0}),
    _sample(2.0, "during", {"running": 4, "waiting": 3}, {"running": 1, "waiting": 0}),
    _sample(3.0, "after", {"prefix_queries": 500, "prefix_hits": 250, "prompt_tokens": 500, "requests_ok": 6,
                           "running": 0, "waiting": 0},
            {"prefix_queries": 150, "prefix_hits": 10, "prompt_tokens": 100, "requests_ok": 1, "running": 0}),
]


def test_report_from_headers_and_labelled_scrapes() -> None:
    plan = ReplicaPlan(labelled_url="http://gw/metrics/replicas")
    rep = build_report(RECORDS, SAMPLES, plan, prefix_share=0.8)
    assert rep is not None and rep.source == "http://gw/metrics/replicas" and not rep.routed
    r1, r2 = rep.replicas
    assert (r1.replica, r1.lane, r1.num_requests, r1.requests_source) == ("r1", "short", 5, "x-kvpilot-replica")
    assert (r1.prompt_tokens, r1.prefix_hits, r1.prefix_queries, r1.prefix_hit_rate) == (400, 240, 400, 0.6)
    assert (r1.running_mean, r1.running_max, r1.waiting_mean, r1.waiting_max) == (3.0, 4, 2.0, 3)
    # r2: one successful request (the failed one is not served); its counters appeared during the run (0 before)
    assert (r2.num_requests, r2.prompt_tokens, r2.prefix_hits, r2.prefix_queries) == (1, 100, 10, 100)
    assert r2.prefix_hit_rate == pytest.approx(0.1)
    assert rep.imbalance == pytest.approx(5 / 3)  # max 5 / mean 3
    assert (rep.prefix_spread, rep.num_prefix_groups) == (1.5, 2)  # prefix-0 on 2 replicas, prefix-1 on 1
    assert rep.hit_rate == pytest.approx(250 / 500)
    assert rep.offered_reuse == pytest.approx(0.8 * 200 / 600)  # requests 2 and 4 of 6 ok ones, 100 tokens each
    assert ReplicaReport.from_json(rep.to_json()) == rep
    assert rep.to_json()["per_replica"][0]["prefix_hit_rate"] == 0.6


def test_counts_fall_back_to_the_servers_counter_when_ids_differ() -> None:
    """Scraped by URL behind a gateway whose header names replicas otherwise: the counters say who served."""
    named = [rec(i, f"pod-{i % 2}", "prefix-0", 0.1 * i) for i in range(4)]
    rep = build_report(named, SAMPLES, ReplicaPlan(labelled_url="http://gw/metrics/replicas"))
    assert rep is not None
    assert [(r.replica, r.num_requests, r.requests_source) for r in rep.replicas] == [
        ("r1", 5, "vllm:request_success_total"), ("r2", 1, "vllm:request_success_total")]
    assert rep.prefix_spread is None and rep.offered_reuse is None
    assert rep.imbalance == pytest.approx(5 / 3)


def test_routed_urls_and_a_plain_server() -> None:
    plan = ReplicaPlan(urls=("http://a/", "http://b"), route=True)
    records = [rec(i, ["http://a", "http://b"][i % 2], f"prefix-{i // 2}", 0.0) for i in range(6)]
    rep = build_report(records, [], plan)
    assert rep is not None and rep.routed and rep.source == "<url>/metrics of each replica URL"
    assert [(r.replica, r.num_requests, r.requests_source, r.prefix_hits) for r in rep.replicas] == [
        ("http://a", 3, "client round-robin", None), ("http://b", 3, "client round-robin", None)]
    assert (rep.imbalance, rep.prefix_spread, rep.hit_rate) == (1.0, 2.0, None)
    assert build_report(records[:0], [], None) is None
    assert build_report([rec(0, None, None, 0.0)], [], None) is None  # no plan, no header: a single server
    header_only = build_report(RECORDS, [], None)
    assert header_only is not None and header_only.source == "x-kvpilot-replica header"
    assert [(r.replica, r.num_requests) for r in header_only.replicas] == [("r1", 5), ("r2", 1)]


def test_imbalance_is_per_lane() -> None:
    assert imbalance([("a", 4), ("a", 2), ("b", 1), ("b", 1)]) == pytest.approx(4 / 3)
    assert imbalance([("a", 5), ("a", 5), ("b", 90), ("b", 10)]) == pytest.approx(1.8)
    assert imbalance([(None, 3), (None, 0)]) == 2.0  # an idle replica counts
    assert imbalance([("a", 0), ("a", 0)]) is None


def test_prefix_spread_counts_groups_with_two_served_requests() -> None:
    records = [rec(0, "x", "prefix-0", 0), rec(1, "y", "prefix-0", 0), rec(2, "z", "prefix-0", 0),
               rec(3, "x", "session-1", 0), rec(4, "x", "session-1", 0), rec(5, "y", "prefix-2", 0),
               rec(6, "x", "long", 0), rec(7, "y", "long", 0), rec(8, "y", "prefix-3", 0, ok=False),
               rec(9, "x", "prefix-3", 0)]
    assert prefix_spread(records) == (2.0, 2)  # prefix-0: 3, session-1: 1; single ones and long/short not
    assert prefix_spread([rec(0, None, "prefix-0", 0), rec(1, None, "prefix-0", 0)]) == (None, 0)


def test_offered_reuse_waits_for_the_first_token_of_the_group() -> None:
    """A request sent before its group's first token arrived cannot reuse the prefix in any engine."""
    records = [rec(0, None, "prefix-0", 0.0, ttft_ms=100), rec(1, None, "prefix-0", 0.099),
               rec(2, None, "prefix-0", 0.1), rec(3, None, "prefix-1", 1.0, prompt=200),
               rec(4, None, None, 2.0, prompt=100)]
    assert offered_reuse(records, 0.5) == pytest.approx(0.5 * 100 / 600)
    assert offered_reuse(records, None) is None
