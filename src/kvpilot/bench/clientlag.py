"""Did the client keep up? Judges dispatch lag and event-loop lag so that a slow client is reported
as such instead of being mistaken for a slow server."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.bench.records import RequestRecord
from kvpilot.bench.stats import Distribution

DEFAULT_MAX_LAG_MS = 10.0
MAX_LAG_SAMPLES = 2000


@dataclass(frozen=True)
class ClientLag:
    """``dispatch_lag_ms``: how late requests were sent versus plan; ``loop_lag_ms``: how late 10 ms
    event-loop ticks fired. ``overloaded`` when either p99 exceeds ``max_lag_ms``."""

    dispatch_lag_ms: Distribution
    loop_lag_ms: Distribution
    loop_lag_samples: list[tuple[float, float]]
    max_lag_ms: float
    overloaded: bool
    message: str

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["loop_lag_samples"] = [list(s) for s in self.loop_lag_samples]
        return d


def judge_client_lag(records: list[RequestRecord], loop_lag: list[tuple[float, float]],
                     max_lag_ms: float = DEFAULT_MAX_LAG_MS, has_schedule: bool = True) -> ClientLag:
    """``has_schedule`` False (an all-at-once burst) leaves dispatch lag out of the verdict: with no
    planned times to keep, sending N requests one after another is not falling behind."""
    dispatch = Distribution.of(r.sched_lag_ms for r in records)
    loop = Distribution.of(lag for _, lag in loop_lag)
    worst = max(dispatch.p99 or 0.0 if has_schedule else 0.0, loop.p99 or 0.0)
    overloaded = worst > max_lag_ms
    lags = f"p99 dispatch lag {dispatch.p99 or 0:.1f} ms, p99 event-loop lag {loop.p99 or 0:.1f} ms"
    message = (f"CLIENT OVERLOADED: {lags} (limit {max_lag_ms:g} ms). Latencies include client delay, "
               f"not only the server's: lower the rate per client, or split it with --client-processes N."
               if overloaded else f"client kept up ({lags}; limit {max_lag_ms:g} ms)")
    step = max(1, len(loop_lag) // MAX_LAG_SAMPLES)  # keep the result file small on long runs
    return ClientLag(dispatch, loop, loop_lag[::step], max_lag_ms, overloaded, message)
