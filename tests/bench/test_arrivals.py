"""Arrival schedules and load-shape validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvpilot.bench.arrivals import LoadShapeError, arrival_times
from kvpilot.bench.load import LoadShape


def test_poisson_rate_and_burstiness() -> None:
    rng = np.random.default_rng(1)
    times = arrival_times(10.0, 20_000, rng)
    gaps = np.diff([0.0, *times])
    assert abs(len(times) / times[-1] - 10.0) < 0.3
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: CV = 1
    bursty = np.diff([0.0, *arrival_times(10.0, 20_000, rng, burstiness=0.25)])
    assert abs(bursty.mean() - 0.1) < 0.01 and bursty.std() / bursty.mean() > 1.8  # CV = 1/sqrt(k) = 2


def test_constant_and_infinite_rates() -> None:
    rng = np.random.default_rng(0)
    assert arrival_times(4.0, 3, rng, "constant") == pytest.approx([0.25, 0.5, 0.75])
    assert arrival_times(math.inf, 3, rng) == [0.0, 0.0, 0.0]


def test_bad_load_shapes_raise_with_the_flag_name() -> None:
    with pytest.raises(LoadShapeError, match="--request-rate"):
        arrival_times(0.0, 1, np.random.default_rng(0))
    with pytest.raises(LoadShapeError, match="--concurrency"):
        LoadShape(concurrency=0)
    with pytest.raises(LoadShapeError, match="--num-requests or --duration"):
        LoadShape(num_requests=None)
    assert LoadShape(request_rate=2.0, max_concurrency=4).label() == "rate=2/s, max_concurrency=4"


def test_duration_alone_needs_a_finite_rate() -> None:
    with pytest.raises(LoadShapeError, match="without end"):
        LoadShape(num_requests=None, duration_s=1.0)
    assert LoadShape(num_requests=None, duration_s=1.0, request_rate=5.0).duration_s == 1.0
