"""Metric math on hand-made records: TPOT definition, percentiles, SLO parsing, goodput, errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvpilot.bench.records import RequestRecord, record_from_json
from kvpilot.bench.stats import Distribution, SloError, aggregate, meets_slo, parse_slo

BASE = RequestRecord(request_index=0, item_id=0, turn_index=0, group_id=None, ok=True, status=200,
                     error_kind=None, error=None, scheduled_s=0.0, sent_s=0.0, queue_wait_ms=0.0,
                     sched_lag_ms=0.0, ttft_ms=100.0, e2e_ms=1000.0, itl_ms=(300.0, 300.0, 300.0),
                     num_prompt_tokens=10, num_output_tokens=4, output_tokens_source="usage", num_chunks=4)


def rec(**kw: Any) -> RequestRecord:
    return dataclasses.replace(BASE, **kw)


def test_tpot_is_vllms_definition() -> None:
    assert rec().tpot_ms == pytest.approx((1000 - 100) / 3)
    assert rec(num_output_tokens=1).tpot_ms is None
    assert rec(ok=False, status=500, error_kind="http_status").tpot_ms is None


def test_distribution_percentiles() -> None:
    d = Distribution.of(float(x) for x in range(1, 101))
    assert d.num_samples == 100 and d.mean == pytest.approx(50.5) and d.max == 100
    assert d.median == pytest.approx(50.5) and d.p99 == pytest.approx(99.01)
    assert Distribution.of([]).mean is None


def test_parse_slo_units_and_errors() -> None:
    assert parse_slo("ttft=200ms,tpot=50ms,e2e=5s,itl=80") == {"ttft": 200, "tpot": 50, "e2e": 5000, "itl": 80}
    assert parse_slo(None) == {}
    for bad in ("ttft", "speed=3ms", "ttft=fast"):
        with pytest.raises(SloError, match="bad SLO"):
            parse_slo(bad)


def test_goodput_counts_requests_within_every_slo() -> None:
    records = [rec(request_index=0), rec(request_index=1, ttft_ms=500.0),
               rec(request_index=2, itl_ms=(10.0, 900.0, 10.0)),
               rec(request_index=3, ok=False, status=500, error_kind="http_status", ttft_ms=None)]
    slos = parse_slo("ttft=200ms,itl=400ms")
    assert [meets_slo(r, slos) for r in records] == [True, False, False, False]
    agg = aggregate(records, slos, duration_s=2.0)
    assert agg.num_good == 1 and agg.goodput == pytest.approx(0.5) and agg.good_fraction == 0.25
    assert agg.errors_by_kind == {"http_500": 1}
    assert agg.request_throughput == pytest.approx(1.5)
    assert agg.output_token_throughput == pytest.approx(6.0)
    assert agg.total_token_throughput == pytest.approx(21.0)
    assert agg.itl_ms.num_samples == 9


def test_duration_spans_first_send_to_last_byte() -> None:
    records = [rec(sent_s=1.0, e2e_ms=500.0), rec(request_index=1, sent_s=2.0, e2e_ms=1000.0)]
    assert aggregate(records, {}).duration_s == pytest.approx(2.0)


def test_record_json_round_trip() -> None:
    r = rec(group_id="prefix-1")
    back = record_from_json(r.to_json())
    assert back == dataclasses.replace(r, output_text="")
    assert r.to_json()["tpot_ms"] == pytest.approx(300.0)


def test_latency_by_group() -> None:
    records = [rec(group_id="short", ttft_ms=10.0), rec(request_index=1, group_id="short", ttft_ms=20.0),
               rec(request_index=2, group_id="long", ttft_ms=300.0)]
    groups = aggregate(records, {}).groups_ms
    assert groups is not None and set(groups) == {"short", "long"}
    assert groups["short"]["ttft"].mean == 15.0 and groups["long"]["ttft"].max == 300.0
    many = [rec(request_index=i, group_id=f"session-{i}") for i in range(20)]
    assert aggregate(many, {}).groups_ms is None
