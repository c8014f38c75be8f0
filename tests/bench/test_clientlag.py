"""The bench's client-lag verdict on event-loop samples: rare long stalls count by the time they take."""

from __future__ import annotations

from kvpilot.bench.clientlag import judge_client_lag, stalled_lag_ms


def _ticks(stall_ms: float, every: int, num_ticks: int = 1200) -> list[tuple[float, float]]:
    """One sample per 10 ms tick, 0.4 ms late, with a ``stall_ms`` stall every ``every`` ticks."""
    return [(k * 0.01, stall_ms if k % every == 0 else 0.4) for k in range(num_ticks)]


def test_a_long_stall_once_a_second_is_overload_though_under_one_tick_in_a_hundred() -> None:
    """300 ms once every 120 ticks: under 1% of ticks (per-tick p99 0.4 ms) but a fifth of the time."""
    samples = _ticks(300.0, 120)
    lag = judge_client_lag([], samples)
    assert (lag.loop_lag_ms.p99 or 0.0) < 1.0
    assert lag.loop_stall_ms == stalled_lag_ms(samples) == 300.0
    assert lag.overloaded and "CLIENT OVERLOADED" in lag.message
    assert lag.to_json()["loop_stall_ms"] == 300.0


def test_short_rare_hiccups_stay_within_the_limit() -> None:
    """25 ms once every 120 ticks covers ~3% of the time: below the 5% that counts, so the client kept up."""
    lag = judge_client_lag([], _ticks(25.0, 120))
    assert lag.loop_stall_ms < 1.0 and not lag.overloaded, lag.message
    assert stalled_lag_ms([]) == 0.0
