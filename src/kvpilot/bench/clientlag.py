"""Did the client keep up? Judges dispatch lag and event-loop lag so that a slow client is reported
as such instead of being mistaken for a slow server."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.bench.records import RequestRecord
from kvpilot.bench.stats import Distribution

DEFAULT_MAX_LAG_MS = 10.0
MAX_LAG_SAMPLES = 2000
LOOP_TICK_MS = 10.0  # request_loop.LOOP_TICK_S: the probe asks for one wake-up per tick
STALL_TIME_SHARE = 0.05
"""Stalls that cover this share of a run's time count (:func:`stalled_lag_ms`): one request event in twenty lands
in one. Far above the 1% of a per-tick p99, so the 10-30 ms hiccups of a client sharing cores with a busy server
do not cross it more easily than they cross that p99."""


def stalled_lag_ms(loop_lag: list[tuple[float, float]] | list[list[float]], share: float = STALL_TIME_SHARE) -> float:
    """The event-loop lag judged by the run's *time* rather than by its ticks: the largest lag L such that ticks
    lagging at least L span more than ``share`` of the time the samples cover (a tick spans LOOP_TICK_MS plus its
    lag). A per-tick p99 hides rare long stalls: a 300 ms stall once a second is one late tick among ~70 on time
    (1.4%, and under 1% when the ticks run slow), yet the loop is stalled a fifth of the run and every response
    that arrives then waits for it. 0 without samples."""
    lags = sorted((float(s[1]) for s in loop_lag if len(s) == 2), reverse=True)
    total = sum(lag + LOOP_TICK_MS for lag in lags)
    covered = 0.0
    for lag in lags:
        covered += lag + LOOP_TICK_MS
        if covered > share * total:
            return lag
    return 0.0


@dataclass(frozen=True)
class ClientLag:
    """``dispatch_lag_ms``: how late requests were sent versus plan; ``loop_lag_ms``: how late 10 ms
    event-loop ticks fired; ``loop_stall_ms``: the lag of the stalls that cover 5% of the
    run's time (:func:`stalled_lag_ms`). ``overloaded`` when any of the three exceeds ``max_lag_ms``.
    ``loop_late_ms``: the ticks' lag summed over the run; ``loop_run_delay_ms``: how long the loop's thread waited
    for a CPU meanwhile (runnable, not running: Linux's schedstat), None where unknown. Lateness spent mostly
    waiting for a CPU is the host's doing (other processes held the cores), not the client's own work."""

    dispatch_lag_ms: Distribution
    loop_lag_ms: Distribution
    loop_lag_samples: list[tuple[float, float]]
    max_lag_ms: float
    overloaded: bool
    message: str
    loop_stall_ms: float = 0.0
    loop_late_ms: float = 0.0
    loop_run_delay_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["loop_lag_samples"] = [list(s) for s in self.loop_lag_samples]
        return d


def judge_client_lag(records: list[RequestRecord], loop_lag: list[tuple[float, float]],
                     max_lag_ms: float = DEFAULT_MAX_LAG_MS, has_schedule: bool = True,
                     loop_run_delay_ms: float | None = None) -> ClientLag:
    """``has_schedule`` False (an all-at-once burst) leaves dispatch lag out of the verdict: with no
    planned times to keep, sending N requests one after another is not falling behind."""
    dispatch = Distribution.of(r.sched_lag_ms for r in records)
    loop = Distribution.of(lag for _, lag in loop_lag)
    stall = stalled_lag_ms(loop_lag)
    worst = max(dispatch.p99 or 0.0 if has_schedule else 0.0, loop.p99 or 0.0, stall)
    overloaded = worst > max_lag_ms
    lags = (f"p99 dispatch lag {dispatch.p99 or 0:.1f} ms, p99 event-loop lag {loop.p99 or 0:.1f} ms "
            f"(stalls of {stall:.1f} ms cover {STALL_TIME_SHARE:.0%} of the time)")
    message = (f"CLIENT OVERLOADED: {lags} (limit {max_lag_ms:g} ms). Latencies include client delay, "
               f"not only the server's: lower the rate per client, or split it with --client-processes N."
               if overloaded else f"client kept up ({lags}; limit {max_lag_ms:g} ms)")
    step = max(1, len(loop_lag) // MAX_LAG_SAMPLES)  # keep the result file small on long runs
    return ClientLag(dispatch, loop, loop_lag[::step], max_lag_ms, overloaded, message, stall,
                     sum(lag for _, lag in loop_lag), loop_run_delay_ms)


def thread_run_delay_ms() -> float | None:
    """How long the calling thread has waited for a CPU since it started (ms; Linux's
    /proc/thread-self/schedstat, its second field), None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None
