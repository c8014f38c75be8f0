"""Prefix-cache and offload-tier hits of a multi-turn run (issue #49 item 4): first and returning turns apart,
from kvpilot's field or the OpenAI usage, and the server's counters over the run."""

from __future__ import annotations

import dataclasses

from kvpilot.bench.cache_hits import cache_hits
from kvpilot.bench.records import record_from_json
from kvpilot.bench.request_loop import usage_cached_tokens
from kvpilot.bench.scrape import MetricsSample, summarize
from tests.doctor.builders import req


def _turns() -> list:
    """Two sessions of two turns: first turns nothing cached; returning turns 96 of 160 cached, 64 of them
    copied back from the offload tier; one vLLM-style record with only the usage's cached count."""
    first = [req(i, 0.0, prompt=64, cached=0) for i in range(2)]
    back = req(2, 1.0, prompt=160, cached=96)
    back = dataclasses.replace(back, turn_index=1, server=dataclasses.replace(back.server, num_tier_cached_tokens=64))
    usage_only = dataclasses.replace(req(3, 1.0, prompt=160, server=False), turn_index=1, num_usage_cached_tokens=80)
    return [*first, back, usage_only]


def test_returning_turns_count_pool_and_tier_hits() -> None:
    metrics = [MetricsSample(0.0, "before", {"prefix_queries": 0.0, "prefix_hits": 0.0,
                                             "external_prefix_queries": 0.0, "external_prefix_hits": 0.0}),
               MetricsSample(2.0, "after", {"prefix_queries": 448.0, "prefix_hits": 112.0,
                                            "external_prefix_queries": 448.0, "external_prefix_hits": 64.0})]
    hits = cache_hits(_turns(), summarize(metrics))
    assert hits is not None
    assert (hits.first.num_requests, hits.first.num_cached_tokens, hits.first.hit_rate) == (2, 0, 0.0)
    r = hits.returning
    assert (r.num_requests, r.num_prompt_tokens, r.num_cached_tokens, r.num_tier_cached_tokens) == (2, 320, 176, 64)
    assert (hits.server_prefix_hits, hits.server_tier_hits) == (112.0, 64.0)
    assert hits.lines()[1] == ("returning turns: 2 requests, 176 of 320 prompt tokens cached (55%), 64 of them from "
                               "the KV offload tier")
    assert hits.to_json()["returning"]["hit_rate"] == 176 / 320


def test_cached_counts_survive_the_result_file_and_come_from_the_usage() -> None:
    rec = _turns()[2]
    assert record_from_json(rec.to_json()).server.num_tier_cached_tokens == 64
    assert usage_cached_tokens({"prompt_tokens": 160, "prompt_tokens_details": {"cached_tokens": 80}}) == 80
    assert usage_cached_tokens({"prompt_tokens": 160}) is None
