"""BatchHistogram exposes what prometheus_client's Histogram exposes for the same values (the series a
dashboard or `kvpilot doctor` reads), less the `_created` sample."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvpilot.server.observe.batch_histogram import BatchHistogram
from kvpilot.server.observe.metrics import ITL_BUCKETS


def _series(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_batch_histogram_matches_prometheus_histogram() -> None:
    rng = random.Random(0)
    # values on the bounds themselves (le is inclusive), between them, below the first and above the last
    values = [*ITL_BUCKETS, 0.0, 1e-6, 100.0, 1e9] + [rng.expovariate(20.0) for _ in range(500)]
    reference, batched = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ["model_name"],
                          buckets=ITL_BUCKETS, registry=reference).labels("m")
    batch = BatchHistogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ["model_name"],
                           ["m"], buckets=ITL_BUCKETS, registry=batched)
    for value in values:
        histogram.observe(value)
    batch.observe_many(values[:100])
    batch.observe_many([])
    batch.observe_many((values[100],))  # a batch of one
    batch.observe_many(iter(values[101:]))
    expected, got = _series(reference), _series(batched)
    # the sums may differ in the last digit (fsum of a batch against one float add a value)
    assert [line for line in got if "_sum" not in line] == [line for line in expected if "_sum" not in line]
    got_sum = float(next(line for line in got if "_sum" in line).split()[-1])
    assert got_sum == pytest.approx(sum(values), rel=1e-12)
    assert f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {float(len(values))}' in got


def test_batch_histogram_refuses_unsorted_buckets() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        BatchHistogram("h", "doc", [], [], buckets=(0.1, 0.05))
